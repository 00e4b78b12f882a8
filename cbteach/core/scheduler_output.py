"""What the scheduler hands the model runner: the plan for one step (vLLM V1's ``SchedulerOutput``).

It is plain data. For each sequence in the batch: ``num_scheduled_tokens`` (how many of its tokens
go through the model now), a snapshot of ``num_computed_tokens`` taken when it was planned (where
they start: the scheduler moves the sequence's own count on at the end of ``schedule()``, as vLLM
V1's ``_update_after_schedule`` does, so the snapshot is what the model runner reads), and
``num_draft_tokens`` (how many of them are speculative guesses fed past the known tokens). Plus who
was admitted, preempted or swapped in while planning -- for the engine's step record.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .request import Sequence


@dataclass
class SchedulerOutput:
    """The plan for one step. ``seqs[i]`` feeds ``num_scheduled_tokens[i]`` tokens, starting at
    position ``num_computed_tokens[i]``; the last ``num_draft_tokens[i]`` of them are guesses."""

    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_draft_tokens: list[int] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)  # "decode" or "prefill", as planned (for the step record)
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # recomputed later or swapped out
    swapped_in: list[Sequence] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def add(self, seq: Sequence, n: int) -> None:
        """Schedule ``n`` tokens of ``seq`` from its ``num_computed_tokens`` on (its KV room is taken)."""
        n = int(n)
        self.seqs.append(seq)
        self.num_scheduled_tokens.append(n)
        self.num_computed_tokens.append(seq.num_computed_tokens)
        # Tokens past the known ones are speculative guesses (seq.draft_ids): counted once, here.
        self.num_draft_tokens.append(max(0, seq.num_computed_tokens + n - seq.num_tokens_with_placeholders))
        self.kinds.append("decode" if seq.is_decoding else "prefill")

    def remove(self, seq: Sequence) -> int:
        """Take ``seq`` out of the plan (it was preempted after being scheduled); returns its tokens."""
        if seq not in self.seqs:
            return 0
        i = self.seqs.index(seq)
        self.seqs.pop(i)
        self.num_computed_tokens.pop(i)
        self.num_draft_tokens.pop(i)
        self.kinds.pop(i)
        return self.num_scheduled_tokens.pop(i)

    def subset(self, indices: list[int]) -> SchedulerOutput:
        """The plan for sequences ``indices`` only (to run them alone), without admission events."""
        sub = SchedulerOutput()
        for name in ("seqs", "num_scheduled_tokens", "num_computed_tokens", "num_draft_tokens", "kinds"):
            setattr(sub, name, [getattr(self, name)[i] for i in indices])
        return sub
