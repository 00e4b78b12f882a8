"""The continuous-batching engine: iteration-level scheduling + ragged packing, one step at a time.

:class:`Engine` is the :class:`~cbteach.engine.engine_core.EngineCore` (the step loop: schedule,
execute, update -- vLLM V1's split, Orca's refill, Sarathi-Serve's chunks, PagedAttention's
preemption) with the request API around it: :meth:`Engine.add_request`, :meth:`Engine.run`,
:meth:`Engine.stream`, :meth:`Engine.abort`, :meth:`Engine.close`.

The options are validated once into an :class:`~cbteach.core.config.EngineConfig`. The model is
never changed: the engine runs its own view of it (:mod:`cbteach.core.model_view`), and refuses to
go on if the model changes under it (:mod:`cbteach.engine.fingerprint`). Plug points for your own
pieces: ``scheduler_cls``, ``kv_manager``, ``attention`` and ``slot_mapping`` (notebooks 05, 06, 12;
:mod:`cbteach.engine.plug`).

Greedy decoding in fp32 gives token for token what per-prompt ``model.generate`` gives for plain
greedy search; the tests check exactly that. **Time**: every time in a
:class:`~cbteach.core.request.Completion` is on the engine's clock (:meth:`Engine.now`; seconds
since the engine was made, or simulated: :mod:`cbteach.core.clock`). An ``arrival_time`` of
``None`` means "when it is added"; a number means "not before", on the engine clock for
:meth:`add_request` and from the start of the call for :meth:`run`; never an absolute clock time.
"""
from __future__ import annotations

import functools
import time
import warnings

from ..core.request import Completion, Request, Sequence
from ..core.validation import as_request_list, validate_request
from . import parallel_sampling
from .engine_core import EngineCore
from .plug import plug_pieces
from .scheduler_v0 import V0StepPlan
from .streaming import StreamEvent, stream_events  # noqa: F401  (StreamEvent: part of the engine's API)

MAX_WALL_WAIT = 86_400.0  # seconds: on the wall clock, an arrival_time further ahead than a day is refused
LONG_WAIT = 60.0  # seconds: waiting this long for an arrival on the wall clock is said (a warning)


class Engine(EngineCore):
    """A small continuous-batching inference engine over a transformers causal LM.

    ``Engine(model, tokenizer, max_batch_size=8)`` keeps the concatenating KV cache; ``kv="paged"``
    (with ``block_size``, ``num_blocks`` or ``kv_memory_bytes``) uses the paged one. ``token_budget``
    caps the tokens of one step (longer prompts are prefilled in chunks); ``policy`` is ``"fcfs"`` or
    ``"priority"``; ``parallel_sampling`` is ``"fanout"`` (V1) or ``"fork"`` (copy on write);
    ``async_scheduling`` overlaps planning with the forward pass; ``tensor_parallel_size`` shards the
    model over processes. vLLM V0's rules are options named as V0's: ``admission="whole_prompt"``,
    ``watermark`` (both also current V1's, in its own form), ``preemption="swap"``, ``preempt_to_admit``. ``keep_records=False`` keeps no step
    history. See :class:`~cbteach.core.config.EngineConfig` for every option; use it as a context
    manager, or call :meth:`close`, to let go of its KV memory (and worker processes).
    """

    def check_request(self, request: Request, taken=()) -> list[int]:
        """Everything that can be wrong with ``request``, found before it touches the engine: raises
        ``ValueError`` saying what, or returns its prompt as token ids (``taken``: ids about to be used)."""
        prompt_ids = validate_request(request, tokenizer=self.tokenizer, vocab_size=self.info.vocab_size,
                                      max_pos=self.info.max_positions)
        rid, n = request.request_id, request.sampling_params.n
        clash = next((i for i in _ids_of(rid, n) if i in self.sequences or i in self.groups or i in taken), None)
        if clash is not None:
            which = f"request_id {rid!r}" if clash == rid else f"id {clash!r} (a sample of request {rid!r})"
            raise ValueError(f"duplicate {which}: every request needs its own id (a request with n > 1 "
                             "samples also takes the ids (request_id, i) of its samples)")
        if n > 1 and self.config.parallel_sampling == "fork":
            from ..kv.fork import can_fork  # (imported only where it is used)

            if not can_fork(self.kv.manager):
                raise ValueError(f"request {rid!r} asks for n={n} samples, but this engine's KV manager "
                                 f"({type(self.kv.manager).__name__}) cannot share blocks with copy on write, which "
                                 "parallel_sampling='fork' needs; use parallel_sampling='fanout' (vLLM V1's default)")
            if n > self.scheduler.max_batch_size:
                raise ValueError(f"request {rid!r} asks for n={n} samples, but a batch holds at most "
                                 f"{self.scheduler.max_batch_size} sequences (max_batch_size) and forked samples run "
                                 "together; use parallel_sampling='fanout', whose samples take turns")
        # Each sample must fit alone: with less room, samples are preempted and take turns.
        self.kv.check_fits(len(prompt_ids) + request.max_new_tokens, rid)
        return prompt_ids

    @property
    def spec_stats(self) -> dict:
        """Speculative decoding's guesses so far: ``drafted`` (fed), ``accepted`` (kept) and
        ``verify_steps`` (request-steps that checked guesses); all 0 when the engine does not speculate."""
        return getattr(self.scheduler, "spec_stats", None) or {"drafted": 0, "accepted": 0, "verify_steps": 0}

    def add_request(self, request: Request):
        """Validate and queue a request; returns its ``request_id``. Bad input raises ``ValueError``.
        An explicit ``arrival_time`` is a time on the engine's clock (:meth:`now`); ``None`` means now."""
        self._check_open()
        prompt_ids = self.check_request(request)
        now = self.now()
        at = now if request.arrival_time is None else float(request.arrival_time)
        self._check_wait(request, at - now)
        self._enqueue(request, prompt_ids, at)
        return request.request_id

    def receive(self, seq: Sequence, kv_blocks) -> None:
        """Take in a sequence whose K/V were computed elsewhere (a disaggregated prefill engine's
        handover): ``kv_blocks`` (per layer, host copies of its blocks) wait in host memory until
        ``seq.ready_time``, then come back like a swapped-out request's."""
        if self.kv.kind != "paged" or self.stepper is not None or self.config.tensor_parallel_size > 1:
            raise ValueError("receive() needs kv='paged' (handed-over K/V arrive as blocks), no async_scheduling and "
                             "one process")
        if not callable(getattr(self.scheduler, "add_swapped", None)):
            raise ValueError("receive() brings K/V back the way V0's swap does: build the engine with "
                             "scheduler_cls=cbteach.engine.scheduler_v0.V0Scheduler")
        self.check_request(seq.request)
        self.sequences[seq.request_id] = seq
        self.kv.hold_swapped(seq.request_id, kv_blocks)
        self.scheduler.add_swapped(seq)

    def use_kv_manager(self, manager) -> None:
        """Make ``manager`` (a :class:`cbteach.kv.interface.KVManager`) the paged cache's KV manager on a
        fresh engine -- what ``Engine(..., kv_manager=manager)`` does at construction."""
        if self.has_unfinished() or self.num_steps:
            raise ValueError("plug a KV manager into a fresh engine, before any request is added")
        plug_pieces(self.kv, kv_manager=manager)
        self.scheduler.kv_manager = self.kv.manager

    def on_release(self, callback) -> None:
        """Call ``callback(seq)`` just before a sequence's KV blocks are given back (it finished, was
        aborted or preempted), while its K/V are still in the pool: a disaggregated prefill engine
        ships them from there (:meth:`copy_kv_out`). Paged only. The KV manager's ``free`` is wrapped,
        on this engine's manager only (a second call replaces the first callback): the manager V1's
        path reads has no such hook."""
        if not callable(callback):
            raise ValueError(f"on_release() takes a function called as callback(seq), got {type(callback).__name__}")
        if self.config.tensor_parallel_size > 1:
            raise ValueError("on_release() needs the K/V in this process; with tensor_parallel_size > 1 the ranks hold them")
        if self.kv.kind != "paged" or self.stepper is not None:
            raise ValueError("on_release() needs kv='paged' and no async_scheduling (blocks are copied out as they "
                             "are freed, which must not overlap a forward pass)")
        manager = self.kv.manager
        free = functools.partial(type(manager).free, manager)  # the class's own

        def free_after_callback(seq):
            callback(seq)
            free(seq)

        manager.free = free_after_callback

    def copy_kv_out(self, seq: Sequence) -> tuple[list, int]:
        """Host copies of the blocks holding ``seq``'s computed tokens, and their bytes (paged only)."""
        from ..kv.swap import host_copy  # (imported only where it is used)

        return host_copy(self.kv, seq)

    def run(self, requests, progress: bool = False) -> list[Completion]:
        """Add ``requests``, step until all are done, and return their completions in request order
        (an explicit ``arrival_time`` counts seconds from the start of this call). All requests are
        validated before any is queued: a bad one raises ``ValueError`` and leaves the engine as it was.
        ``progress=True`` shows a bar of finished requests (one with ``n`` samples: when all are done)."""
        self._check_open()
        requests = self._add_all(requests)
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(requests), desc="requests", unit="req")
        while self.has_requests():  # (after the last request: one more message tells the worker who finished)
            record = self._step()
            if bar is not None:
                bar.update(sum(r.request_id in self.completions for r in requests) - bar.n)
            if record.idle:
                self.wait_for_arrival()
        if bar is not None:
            bar.close()
        return [self.completions[r.request_id] for r in requests]

    def wait_for_arrival(self) -> None:
        """Nothing could be scheduled: wait (sleep, or move a simulated clock) until the scheduler's next
        event. With none due, work that cannot be scheduled is a scheduler bug: ``RuntimeError``."""
        now = self.now()
        # An event due between the last step's planning and now is due at once: step again.
        nxt = self.scheduler.next_event_time(min(now, self._last_start))
        if nxt is not None:
            if nxt <= now:
                return
            if self.clock is not None:
                self.clock.advance(nxt - now)
                return
            if nxt - now >= LONG_WAIT:
                warnings.warn(f"the engine is idle until the next arrival_time, {nxt - now:,.0f} s from now on its wall "
                              "clock: arrival times count seconds on the engine's clock (Engine.now()), or from the "
                              "call for run() -- not time.perf_counter() or time.monotonic() readings", stacklevel=2)
            time.sleep(nxt - now)
        elif self.has_unfinished() and self._last_idle:  # (after a step that only preempted, step again)
            raise RuntimeError(f"the scheduler made no progress with {len(self.scheduler.running)} running and "
                               f"{len(self.scheduler.waiting)} waiting requests; please report this")

    def sample_ids(self, request_id) -> list:
        """The sequence ids of a request: ``[request_id]``, or ``[(request_id, i) ...]`` for ``n > 1``."""
        group = self.groups.get(request_id)
        return [request_id] if group is None else [s.request_id for s in group]

    def stream(self, requests=()):
        """Add ``requests`` (validated as in :meth:`run`) and yield a
        :class:`~cbteach.engine.streaming.StreamEvent` per generated token, as soon as its step ends,
        until they are all done -- also requests added with :meth:`add_request` while streaming.
        Every request the stream covers ends with exactly one event carrying a ``finish_reason``,
        whoever drove the engine in between (another stream, :meth:`run`, :meth:`step`)."""
        self._check_open()
        return stream_events(self, self._add_all(requests))

    def abort(self, request_id, error: str | None = None) -> Completion:
        """Cancel a queued, running or swapped-out request -- all its samples, or one sample given its
        id ``(request_id, i)`` (vLLM's rule). Its KV blocks are freed at once, and its
        :class:`Completion` (``finish_reason="aborted"``, with what it generated so far) is returned;
        with ``error`` (what went wrong for this request alone), ``finish_reason="error"`` instead."""
        try:
            seqs = self.groups.get(request_id) or [self.sequences[request_id]]
        except (TypeError, KeyError):
            raise ValueError(f"unknown request_id {request_id!r}: no such request was added to this engine") from None
        live = [s for s in seqs if not s.status.is_finished]
        if not live:
            raise ValueError(f"request {request_id!r} is already {seqs[0].status.value}; only a queued, running or "
                             "swapped-out request can be aborted")
        if self.stepper is not None:
            self.stepper.drain()  # the step in flight ends first: nobody is aborted half-way through one
        held_on_host = any(s in getattr(self.scheduler, "swapped", ()) for s in live)  # (V0's swap)
        for seq in live:
            group = self.groups.get(seq.request.request_id, [seq])
            parallel_sampling.abort_sample(self.scheduler, seq, group)
            seq.finish_reason, seq.error = ("aborted", seq.error) if error is None else ("error", str(error))
            self._complete(seq, self.now())
        if held_on_host:  # V0's swap: the worker keeps a host copy until a message says the request finished
            self.executor.execute_model(self.scheduler.make_output(V0StepPlan()))  # -- send that message now
        return self.completions.get(request_id) or seqs[0].completion

    def release(self, request_id) -> None:
        """Forget a finished (or aborted) request: its sequences and completion leave the engine's
        dictionaries, so a long-running server does not keep every request it ever served."""
        try:
            seqs = self.groups.get(request_id) or [self.sequences.get(request_id)]
        except TypeError:  # an unhashable id was never a request's
            seqs = [None]
        if seqs[0] is None or not all(s.status.is_finished for s in seqs):
            raise ValueError(f"request {request_id!r} is not a finished request of this engine; only a finished "
                             "or aborted request can be released")
        if seqs[0].request.request_id != request_id:  # (request_id, i): one sample of an n > 1 request
            raise ValueError(f"{request_id!r} is one sample of request {seqs[0].request.request_id!r}; a request's "
                             "samples are released together: release the request's own id")
        if self.stepper is not None:  # async: a step in flight may still run its last (wasted) decode, whose
            self.stepper.drain_if_scheduled([s.request_id for s in seqs])  # token must not reach a new request
        for s in seqs:                                                      # that takes the same id (vLLM PR 27987)
            if self.sequences.get(s.request_id) is s:
                del self.sequences[s.request_id]
        self.groups.pop(request_id, None)
        self.completions.pop(request_id, None)

    def close(self) -> None:
        """Abort what is unfinished and let go of the KV memory and any worker processes; the engine
        cannot be used after this. ``with Engine(...) as eng:`` closes it at the end of the block."""
        if self._closed:
            return
        for seq in list(self.sequences.values()):
            if not seq.status.is_finished:
                self.abort(seq.request_id)
        self._closed = True
        if self.stepper is not None:
            self.stepper.close()
        self.executor.close()
        self.kv.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------
    def _add_all(self, requests) -> list[Request]:
        requests = as_request_list(requests, "Engine.run() and Engine.stream()")
        taken: set = set()
        checked = []
        for r in requests:  # check them all before queuing any
            checked.append(self.check_request(r, taken))
            self._check_wait(r, r.arrival_time or 0.0)
            taken.update(_ids_of(r.request_id, r.sampling_params.n))
        t_run = self.now()
        for r, prompt_ids in zip(requests, checked):
            self._enqueue(r, prompt_ids, t_run + (r.arrival_time or 0.0), claimed=True)
        return requests

    def _check_wait(self, request: Request, wait: float) -> None:
        """On the wall clock an arrival is waited for in real time: one over a day away is a clock reading."""
        if self.clock is None and wait > MAX_WALL_WAIT:
            raise ValueError(
                f"request {request.request_id!r}: arrival_time={request.arrival_time!r} is {wait:,.0f} s from now on "
                "this engine's wall clock, and the engine would wait that long for it: an arrival_time counts seconds "
                "on the engine's clock (Engine.now(): since it was built) for add_request, and from the call for "
                "run() and stream() -- it is not a reading of time.perf_counter() or time.monotonic(). For a trace "
                "longer than a day, give the engine a simulated clock (cbteach.core.clock.VirtualClock)")

    def _enqueue(self, request: Request, prompt_ids: list[int], arrival_time: float, claimed: bool = False):
        mode = self.config.parallel_sampling
        seqs = parallel_sampling.make_samples(request, prompt_ids, arrival_time, claimed, mode)
        for seq in seqs:
            self.sequences[seq.request_id] = seq
        if len(seqs) > 1:
            self.groups[request.request_id] = seqs
        for seq in parallel_sampling.queued(seqs, mode):
            self.scheduler.add(seq)

def _ids_of(request_id, n: int) -> list:
    """The ids a request takes: its own, and ``(request_id, i)`` for each of ``n > 1`` samples."""
    return [request_id] if n == 1 else [request_id] + [(request_id, i) for i in range(n)]
