"""Parallel sampling by fork, on the scheduler's side (``parallel_sampling="fork"``).

PagedAttention's design (Kwon et al., SOSP'23, section 4.4; vLLM V0's sequence groups): sample 0 of a
request with ``n > 1`` computes the prompt once while the others wait in its ``forks``; when its
prefill ends they start *on its blocks*, each with its own first token drawn from the same logits, and
a shared block is copied only when a sample writes into it (:mod:`cbteach.kv.fork`). vLLM V1 has none
of it -- its samples are child requests (``"fanout"``, :mod:`cbteach.engine.parallel_sampling`) -- so
the engine adds it to whichever scheduler it runs, V1's or V0's or a learner's, as the subclass
:class:`ForkingScheduler` (:func:`forking`), only when ``parallel_sampling="fork"`` asks for it:

* **slots**: a prompt is admitted only when a batch slot is free for every one of its samples
  (``num_slots_taken`` counts the samples waiting to fork);
* **the message** is V0's (:class:`~cbteach.engine.scheduler_v0.V0SchedulerOutput`): it carries the
  pool's copies on write (``block_copies``, made by the worker before the forward pass) and, with the
  step that ends a prompt, the samples forking from it (``scheduled_forks``);
* **the update**: the worker's output has each forking prompt's samples' first tokens
  (``output.fork_tokens``); they start when the prompt's own first token is appended -- before the
  prompt may finish and give its blocks back. A sample whose prompt lost its blocks meanwhile (async
  scheduling preempted it while that step was in flight) keeps its first token and computes the
  prompt again. A failed prompt fails the samples waiting on it.

The worker's side is :mod:`cbteach.worker.fork_runner`.
"""
from __future__ import annotations

from ..core.request import RequestStatus, Sequence
from .scheduler import Scheduler
from .scheduler_v0 import V0SchedulerOutput


class ForkingScheduler(Scheduler):
    """The scheduler's rules for ``parallel_sampling="fork"``, over any :class:`Scheduler` (see the module)."""

    def num_slots_taken(self) -> int:
        """Batch slots in use: one per running sequence, plus one per sample waiting to fork from it."""
        return sum(s.num_slots for s in self.running)

    def allocate_admission(self, seq: Sequence, n: int, cached: list, lookahead: int = 0):
        """No room (``None``) unless a batch slot is free for ``seq`` and every sample that forks from it."""
        if self.num_slots_taken() + seq.num_slots > self.max_batch_size:
            return None
        return super().allocate_admission(seq, n, cached, lookahead)

    def extra_output_fields(self, plan) -> dict:
        """V0's message, with the pool's pending copies on write and the samples forking this step --
        from a prompt whose last tokens this step feeds, before it has sampled anything."""
        forks = {seq.request_id: [(f.request_id, f.sample_index) for f in seq.forks]
                 for seq, n in zip(plan.seqs, plan.num_scheduled_tokens)
                 if n > 0 and seq.forks and not seq.output_ids and not seq.num_placeholders
                 and seq.num_computed_tokens + n >= seq.num_tokens}
        take = getattr(self.kv_manager, "take_pending_copies", None)
        return {**super().extra_output_fields(plan), "cls": V0SchedulerOutput,
                "block_copies": list(take()) if take is not None else [], "scheduled_forks": forks}

    def update_from_output(self, scheduler_output, output, now: float) -> list[Sequence]:
        """As the scheduler's own, and the samples given first tokens fork from their prompts (see the module).
        The finished list keeps the step's order: a sample that forked and stopped at once comes just
        before its prompt."""
        drawn = getattr(output, "fork_tokens", None)
        start = scheduler_output.num_computed_tokens_of()
        self._forking = {rid: (drawn[output.req_id_to_index[rid]], start[rid] + n)
                         for rid, n in scheduler_output.num_scheduled_tokens.items()
                         if drawn and drawn[output.req_id_to_index[rid]]}
        self._forked_and_done = []  # (prompt id, sample) for samples that stopped on their first token
        try:
            finished = super().update_from_output(scheduler_output, output, now)
        finally:
            self._forking = {}
        if not self._forked_and_done:
            return finished
        order = {rid: k for k, rid in enumerate(scheduler_output.num_scheduled_tokens)}
        keyed, k = [], -1
        for j, seq in enumerate(finished):  # a sample failed with its prompt comes after the prompt
            k = order.get(seq.request_id, k)
            keyed.append(((k, 1, j), seq))
        keyed += [((order[rid], 0, j), s) for j, (rid, s) in enumerate(self._forked_and_done)]
        return [s for _, s in sorted(keyed, key=lambda e: e[0])]

    def _append(self, seq: Sequence, token: int, now: float) -> bool:
        """Append ``token``; a prompt's first token also starts the samples waiting on it, on its blocks
        (before it may finish and free them)."""
        stops = super()._append(seq, token, now)
        pending = getattr(self, "_forking", {}).pop(seq.request_id, None)
        if pending:
            tokens, computed = pending
            for sample in [f for f in seq.forks if f.request_id in tokens]:
                self._fork(seq, sample, tokens[sample.request_id], computed, now, None)
            seq.forks = [f for f in seq.forks if f.request_id not in tokens]
        return stops

    def _fork(self, parent: Sequence, sample: Sequence, token: int, computed: int, now: float,
              finished: list | None) -> None:
        """Start ``sample`` on ``parent``'s blocks (just computed: its prompt, ``computed`` tokens) with its
        own first token. (Not ``parent.num_computed_tokens``: with async scheduling the parent's next step
        is already planned, and counted.) If the parent lost its blocks meanwhile -- async scheduling
        preempted it while this, its prompt's last step, was in flight -- the sample keeps its first
        token and queues to compute the prompt again, like a request preempted by recompute."""
        if self._append(sample, token, now):
            sample.status = RequestStatus.FINISHED
            self.forget(sample)  # the worker drew its first token: it holds its state
            self._forked_and_done.append((parent.request_id, sample))
            return
        if parent.status is not RequestStatus.RUNNING:
            sample.num_computed_tokens = 0
            sample.status = RequestStatus.PREEMPTED
            self.requests[sample.request_id] = sample
            self.waiting.readd_preempted(sample)
            return
        self.kv_manager.fork(parent, sample)
        sample.num_computed_tokens = computed
        self._start(sample)

    def _fail(self, seq: Sequence, message: str, finished: list, computed_before: int) -> None:
        """The prompt failed: so do the samples still waiting to fork from it."""
        waiting_forks, seq.forks = seq.forks, []
        super()._fail(seq, message, finished, computed_before)
        for sample in waiting_forks:
            sample.finish_reason, sample.error = "error", message
            sample.status = RequestStatus.FINISHED
            self.forget(sample)  # the runner may hold its state: it drew its first token already
            finished.append(sample)


def forking(scheduler_cls: type) -> type:
    """``scheduler_cls`` with :class:`ForkingScheduler`'s rules (its own overrides still come first)."""
    if issubclass(ForkingScheduler, scheduler_cls) or issubclass(scheduler_cls, ForkingScheduler):
        return ForkingScheduler if scheduler_cls is Scheduler else scheduler_cls
    return type(f"Forking{scheduler_cls.__name__}", (scheduler_cls, ForkingScheduler), {})
