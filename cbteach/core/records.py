"""Step records: what each engine step did -- who ran, how many tokens from which position, who was
admitted, preempted or finished -- the one thing the notebooks and visualisers read. What a record says
when read (:mod:`cbteach.core.record_seqs`: its per-sequence view, counts, packed row and mask) is built
then, not in the step; ``Engine(keep_records=False)`` keeps no record past its step."""
from __future__ import annotations

from collections.abc import Sequence as _Sequence
from dataclasses import dataclass, field
from functools import cached_property

from .record_seqs import RecordViews, SeqStep, seq_steps


@dataclass(repr=False)
class StepRecord(RecordViews):
    """What happened on one engine step (what it says when read -- counts, the packed row, the mask -- is
    :class:`~cbteach.core.record_seqs.RecordViews`')."""

    step: int
    kv_kind: str  # "concat" or "paged": decides the key layout of the mask
    seqs: list[SeqStep] = field(default_factory=list)  # (the engine's: a SeqSteps, built when first read)
    admitted: list = field(default_factory=list)
    finished: list = field(default_factory=list)
    preempted: list = field(default_factory=list)
    num_waiting: int = 0
    start_time: float = 0.0  # seconds since the engine started
    duration: float = 0.0  # whole step, scheduling to bookkeeping
    forward_time: float = 0.0  # the model's forward pass alone
    kv_bytes_copied: int = 0  # concat: K/V history copied by gather, DynamicCache and scatter (paged: 0)
    kv_bytes_read: int = 0  # paged: K/V that attention read through the block tables (concat: 0)
    kv_copy_time: float = 0.0
    kv_usage: dict | None = None  # paged cache: pool state after the step (block tables, fill)
    num_all_reduces: int = 0  # a model sharded over processes: all-reduces in this step's forward pass
    all_reduce_bytes: int = 0  # ... and the bytes each process sent into them
    timings: dict = field(default_factory=dict)  # "schedule", "forward", "update" -> perf_counter (start, end)

    @property
    def idle(self) -> bool:
        """No forward pass and no preemption (a step can preempt alone: its first request its own victim)."""
        return not self.seqs and not self.preempted


def fill_record(record: StepRecord, step, out, num_outputs_before: list[int], finished: list,
                fed: bool = True) -> None:
    """Add what the planned ``step`` did, from the runner's output ``out`` and each sequence's output
    length before the update. ``record.seqs`` is built from what is kept here when it is first read (a
    server reads none); ``fed=False`` leaves its ``token_ids`` empty (only the drawings read them)."""
    record.finished = [s.request_id for s in finished]
    seqs = step.seqs
    # What a sequence got is what was appended to it (not a token dropped by the update): its output
    # length now. Its slot and finish reason now too, as they may change after this step.
    now = [(s.slot, len(s.output_ids), s.finish_reason) for s in seqs]
    kept = (step.plan, seqs, step.num_generated, num_outputs_before, now, tuple(finished), fed)
    record.seqs = SeqSteps(len(seqs), kept)
    record.forward_time = out.forward_time
    if out.comm is not None:
        record.num_all_reduces, record.all_reduce_bytes = out.comm["all_reduces"], out.comm["all_reduce_bytes"]
    if out.traffic is not None:  # None: every sequence of the step failed before the cache did anything
        record.kv_bytes_copied, record.kv_bytes_read = out.traffic.bytes_copied, out.traffic.bytes_read
        record.kv_copy_time = out.traffic.seconds


class SeqSteps(_Sequence):
    """A step's :class:`SeqStep` list, built from what the step kept the first time it is read."""

    def __init__(self, n: int, kept: tuple):
        self._n, self._kept = n, kept

    @cached_property
    def _items(self) -> list[SeqStep]:
        return seq_steps(*self._kept)

    def __len__(self) -> int:
        return self._n  # (without building: the step reads it)

    def __getitem__(self, i):
        return self._items[i]

    def __eq__(self, other) -> bool:
        return isinstance(other, _Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(self._items)
