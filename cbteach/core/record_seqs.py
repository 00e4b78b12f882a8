"""A step record's per-sequence view (:class:`SeqStep`), built the first time a record's ``seqs`` is read
-- by a notebook, a drawing, a test -- never inside the step (a server reads none)."""
from __future__ import annotations

from dataclasses import dataclass, field


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
