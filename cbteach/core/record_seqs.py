"""What a step record says when it is read -- by a notebook, a drawing, a test -- never inside the step (a
server reads none): each sequence's part (:class:`SeqStep`, built the first time a record's ``seqs`` is
read) and what follows from them (:class:`RecordViews`: counts, the packed row, its mask)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..attention.packing import block_diagonal_causal_mask, per_sequence_causal_mask


@dataclass
class SeqStep:
    """One sequence's part in one step."""

    request_id: object
    slot: int
    kind: str  # "decode" (it feeds its last sampled token, all before it cached) or "prefill" (anything else)
    num_computed_tokens: int  # tokens already in the KV cache before this step
    num_scheduled_tokens: int  # tokens fed this step
    token_ids: list[int]  # the tokens fed (empty when the engine keeps no records: Engine(keep_records=False))
    sampled: int | None = None  # last token produced by this step (None for a partial prefill chunk)
    new_token_ids: list[int] = field(default_factory=list)  # every token it produced this step
    num_draft_tokens: int = 0  # guesses fed (and checked) in this step (V1's spec tokens)
    finish_reason: str | None = None  # set if the sequence finished on this step

    @property
    def positions(self) -> range:
        return range(self.num_computed_tokens, self.num_computed_tokens + self.num_scheduled_tokens)


def seq_steps(plan, seqs, num_generated, num_outputs_before, now, finished, fed) -> list[SeqStep]:
    """Each sequence's part in a step, from what :func:`~cbteach.core.records.fill_record` kept of it: the
    message ``plan``, the step's sequences, the tokens each had generated when it was planned and before its
    update, ``now`` (slot, output length, finish reason after the update), who finished, and whether to list
    the fed ids. A speculating sequence fed its guesses after its known tokens."""
    starts, ended = plan.num_computed_tokens_of(), {id(s) for s in finished}
    guesses = plan.scheduled_spec_decode_tokens
    steps = []
    for s, g, b, (slot, after, reason) in zip(seqs, num_generated, num_outputs_before, now):
        start, n = starts[s.request_id], plan.num_scheduled_tokens[s.request_id]
        drafts = guesses.get(s.request_id, ()) if guesses else ()
        # A decode feeds its last generated token, everything before it computed (Sequence.is_decoding).
        kind = "decode" if g and start == len(s.prompt_ids) + g - 1 else "prefill"
        steps.append(SeqStep(
            request_id=s.request_id, slot=slot, kind=kind, num_computed_tokens=start, num_scheduled_tokens=n,
            token_ids=_fed(s, start, n - len(drafts), drafts, len(s.prompt_ids) + after) if fed else [],
            sampled=s.output_ids[after - 1] if after > b else None, new_token_ids=s.output_ids[b:after],
            num_draft_tokens=len(drafts), finish_reason=reason if after > b or id(s) in ended else None))
    return steps


def _fed(seq, start: int, n: int, drafts, num_tokens: int) -> list[int]:
    """The ids ``seq`` fed: its tokens ``start .. start + n - 1`` (0 where a failed step gave none), then
    ``drafts``; ``num_tokens``: how many it had after the step."""
    known = max(start, min(start + n, num_tokens))
    return seq.token_ids(start, known) + [0] * (start + n - known) + list(drafts)


class RecordViews:
    """What a :class:`~cbteach.core.records.StepRecord` says, derived from its ``seqs`` when read."""

    more_lists = ()  # a subclass's lists of request ids, shown by repr as admitted, finished and preempted are

    @property
    def num_tokens(self) -> int:
        """Length of the packed row."""
        return sum(s.num_scheduled_tokens for s in self.seqs)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.seqs if s.kind == "prefill")

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.seqs if s.kind == "decode")

    @property
    def is_fused(self) -> bool:
        """A prefill rode in the same forward pass as other sequences' decodes."""
        return {s.kind for s in self.seqs} == {"prefill", "decode"}

    @property
    def input_ids(self) -> list[int]:
        return [t for s in self.seqs for t in s.token_ids]

    @property
    def position_ids(self) -> list[int]:
        return [p for s in self.seqs for p in s.positions]

    @property
    def num_computed_tokens(self) -> list[int]:
        return [s.num_computed_tokens for s in self.seqs]

    @property
    def num_scheduled_tokens(self) -> list[int]:
        return [s.num_scheduled_tokens for s in self.seqs]

    def mask(self) -> torch.Tensor:
        """The step's boolean ``[queries, keys]`` mask, in its cache's key layout."""
        if self.kv_kind == "paged":
            return per_sequence_causal_mask(self.num_computed_tokens, self.num_scheduled_tokens)
        return block_diagonal_causal_mask(self.num_computed_tokens, self.num_scheduled_tokens)

    def __repr__(self) -> str:
        parts = [f"{s.request_id}:{s.kind[0]}{s.num_scheduled_tokens}" for s in self.seqs]
        lists = ("admitted", "finished", "preempted", *self.more_lists)
        extra = "".join(f", {name}={getattr(self, name)}" for name in lists if getattr(self, name))
        return f"StepRecord(step={self.step}, tokens={self.num_tokens} [{' '.join(parts)}]{extra})"
