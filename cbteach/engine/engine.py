"""The continuous-batching engine: iteration-level scheduling + ragged packing, one step at a time.

One call to :meth:`Engine.step` is one forward pass of the model, in three calls (vLLM V1's split):

1. ``plan = scheduler.schedule(now)`` -- who runs and how many tokens each feeds (Orca's refill,
   Sarathi-Serve's chunks, PagedAttention's preemption); it ends by counting the plan as computed
   (V1's ``_update_after_schedule``). :class:`~cbteach.engine.scheduler.Scheduler` in, a
   :class:`~cbteach.core.scheduler_output.SchedulerOutput` out;
2. ``output = runner.execute(plan)`` -- pack those tokens into one ``[1, total_tokens]`` row, run the
   model once with the KV cache's help, sample (:class:`~cbteach.engine.model_runner.ModelRunner`,
   or its tensor-parallel twin: :mod:`cbteach.engine.executor`);
3. ``scheduler.update_from_output(plan, output, now)`` -- tokens appended, rejected guesses taken
   back, finished requests out and their blocks freed (:mod:`cbteach.engine.update`).

With ``async_scheduling=True`` step N+1 is planned while step N's forward runs
(:mod:`cbteach.engine.async_scheduling`); the tokens are the same.

The options are validated once into an :class:`~cbteach.core.config.EngineConfig`. The model is
never changed: the engine runs its own view of it (:mod:`cbteach.core.model_view`), and refuses to
go on if the model changes under it (:mod:`cbteach.engine.fingerprint`). Plug points for your own
pieces: ``scheduler_cls``, ``kv_manager``, ``attention`` and ``slot_mapping`` (notebooks 05, 06, 12).

Greedy decoding in fp32 gives token for token what per-prompt ``model.generate`` gives for plain
greedy search; the tests check exactly that. **Time**: every time in a
:class:`~cbteach.core.request.Completion` is on the engine's clock (:meth:`Engine.now`; seconds
since the engine was made, or simulated: :mod:`cbteach.core.clock`). An ``arrival_time`` of
``None`` means "when it is added"; a number means "not before", on the engine clock for
:meth:`add_request` and from the start of the call for :meth:`run`; never an absolute clock time.
"""
from __future__ import annotations

import time

from ..core import modelinfo
from ..core.config import EngineConfig
from ..core.model_view import model_view
from ..core.records import StepRecord, fill_record, new_record
from ..core.request import Completion, Request, Sequence, as_request_list, validate_request
from ..errors import EngineClosedError
from ..kv.caches import make_kv_cache
from ..kv.manager import can_fork
from . import async_scheduling, parallel_sampling
from .executor import make_runner
from .fingerprint import check_unchanged, fingerprint
from .plug import RuleGuard, plug_pieces
from .scheduler import Scheduler
from .speculative import count_speculation, make_proposer, propose_for
from .streaming import StreamEvent, stream_events  # noqa: F401  (StreamEvent: part of the engine's API)


class Engine:
    """A small continuous-batching inference engine over a transformers causal LM.

    ``Engine(model, tokenizer, max_batch_size=8)`` keeps the concatenating KV cache; ``kv="paged"``
    (with ``block_size``, ``num_blocks`` or ``kv_memory_bytes``) uses the paged one. ``token_budget``
    caps the tokens of one step (longer prompts are prefilled in chunks); ``policy`` is ``"fcfs"`` or
    ``"priority"``; ``parallel_sampling`` is ``"fanout"`` (V1) or ``"fork"`` (copy on write);
    ``async_scheduling`` overlaps planning with the forward pass; ``tensor_parallel_size`` shards the
    model over processes. vLLM V0's rules are options named as V0's: ``admission="whole_prompt"``,
    ``watermark``, ``preemption="swap"``, ``preempt_to_admit``. ``keep_records=False`` keeps no step
    history. See :class:`~cbteach.core.config.EngineConfig` for every option; use it as a context
    manager, or call :meth:`close`, to let go of its KV memory (and worker processes).
    """

    def __init__(self, model, tokenizer=None, *, max_batch_size: int, kv: str = "concat",
                 keep_records: bool = True, clock=None, scheduler_cls=None, kv_manager=None, attention=None,
                 slot_mapping=None, **options):
        self.config = EngineConfig.from_options(max_batch_size=max_batch_size, kv=kv, keep_records=keep_records,
                                                **options)
        if scheduler_cls is not None and not (isinstance(scheduler_cls, type) and issubclass(scheduler_cls, Scheduler)):
            raise ValueError(f"scheduler_cls must be a subclass of cbteach.engine.scheduler.Scheduler, got {scheduler_cls!r}")
        self.info = modelinfo.describe(model, tokenizer)  # refuses models the engine cannot run exactly
        self.proposer = make_proposer(self.config.speculative, self.config.num_speculative_tokens,
                                      vocab_size=self.info.vocab_size)
        self.model = model  # never changed: the runner runs the engine's own view of it
        self.tokenizer = tokenizer
        self.kv = make_kv_cache(self.info, self.config)
        plug_pieces(self.kv, kv_manager=kv_manager, attention=attention, slot_mapping=slot_mapping)
        self.scheduler = (scheduler_cls or Scheduler)(self.config.scheduler, self.kv.manager,
                                                      eos_ids=self.info.eos_ids,
                                                      swapper=self.kv if self.kv.kind == "paged" else None)
        self.runner = make_runner(model, model_view(model, self.kv.attn_implementation), self.info, self.kv,
                                  self.config)
        self.keep_records = self.config.keep_records
        self.records: list[StepRecord] = []
        self.completions: dict[object, Completion] = {}
        self.sequences: dict[object, Sequence] = {}  # every sequence ever added, by id ((id, i) for samples)
        self.groups: dict[object, list[Sequence]] = {}  # requests with n > 1 samples: id -> its samples
        self._num_steps = 0
        self._last_idle = True  # whether the last step did nothing at all (see wait_for_arrival)
        self.spec_stats = {"drafted": 0, "accepted": 0, "verify_steps": 0}  # speculative decoding
        self._t0 = time.perf_counter()
        self.clock = clock  # None: wall time; a VirtualClock: simulated time (cbteach.core.clock)
        self._fingerprint = fingerprint(model, tokenizer)
        self._closed = False
        self._guard = RuleGuard(self.scheduler, self.kv) if scheduler_cls not in (None, Scheduler) else None
        try:
            self._stepper = async_scheduling.AsyncStepper(self) if self.config.async_scheduling else None
        except Exception:
            self.runner.close()  # worker processes started for nothing
            raise

    # -- requests in -------------------------------------------------------------------------
    def now(self) -> float:
        """Seconds on the engine's clock (since the engine was created)."""
        return self.clock() if self.clock is not None else time.perf_counter() - self._t0

    def check_request(self, request: Request, taken=()) -> list[int]:
        """Everything that can be wrong with ``request``, found before it touches the engine: raises
        ``ValueError`` saying what, or returns its prompt as token ids (``taken``: ids about to be used)."""
        prompt_ids = validate_request(request, tokenizer=self.tokenizer, vocab_size=self.info.vocab_size,
                                      max_pos=self.info.max_positions)
        rid, n = request.request_id, request.sampling_params.n
        if any(i in self.sequences or i in self.groups or i in taken for i in _ids_of(rid, n)):
            raise ValueError(f"duplicate request_id {rid!r}: every request needs its own id (a request with n > 1 "
                             "samples also takes the ids (request_id, i) of its samples)")
        if n > 1 and self.config.parallel_sampling == "fork":
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

    def add_request(self, request: Request):
        """Validate and queue a request; returns its ``request_id``. Bad input raises ``ValueError``.
        An explicit ``arrival_time`` is a time on the engine's clock (:meth:`now`); ``None`` means now."""
        self._check_open()
        prompt_ids = self.check_request(request)
        at = self.now() if request.arrival_time is None else float(request.arrival_time)
        self._enqueue(request, prompt_ids, at)
        return request.request_id

    def receive(self, seq: Sequence, kv_blocks) -> None:
        """Take in a sequence whose K/V were computed elsewhere (a disaggregated prefill engine's
        handover): ``kv_blocks`` (per layer, host copies of its blocks) wait in host memory until
        ``seq.ready_time``, then come back like a swapped-out request's."""
        if self.kv.kind != "paged" or self._stepper is not None or self.config.tensor_parallel_size > 1:
            raise ValueError("receive() needs kv='paged' (handed-over K/V arrive as blocks), no async_scheduling and "
                             "one process")
        self.check_request(seq.request)
        self.sequences[seq.request_id] = seq
        self.kv.hold_swapped(seq, kv_blocks)
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
        ships them from there (:meth:`copy_kv_out`). Paged only."""
        if self.config.tensor_parallel_size > 1:
            raise ValueError("on_release() needs the K/V in this process; with tensor_parallel_size > 1 the ranks hold them")
        if self.kv.kind != "paged" or self._stepper is not None:
            raise ValueError("on_release() needs kv='paged' and no async_scheduling (blocks are copied out as they "
                             "are freed, which must not overlap a forward pass)")
        self.kv.manager.before_free = callback

    def copy_kv_out(self, seq: Sequence) -> tuple[list, int]:
        """Host copies of the blocks holding ``seq``'s computed tokens, and their bytes (paged only)."""
        return self.kv.copy_out(seq)

    # -- stepping ----------------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        """Steps run so far -- forward passes, and the rare step that only preempted (idle waits for
        arrivals not counted) -- kept even without records."""
        return self._num_steps

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or (self._stepper is not None and self._stepper.in_flight)

    def kv_usage(self) -> dict:
        """The KV cache's state now (paged: blocks, tokens, utilisation, block tables, pool bytes)."""
        return self.kv.usage()

    def step(self) -> StepRecord:
        """Run one forward pass over everything scheduled and return what happened (with async
        scheduling: finish the step in flight, having launched the next one)."""
        self._check_open()
        return self._step()

    def _step(self) -> StepRecord:
        if self._stepper is not None:
            return self._stepper.step()
        start, t0 = self.now(), time.perf_counter()
        if self.proposer is not None:
            propose_for(self.scheduler.running, self.proposer)
        plan = self.scheduler.schedule(start)  # 1. who runs, how many tokens each
        if self._guard is not None:
            self._guard.after_schedule(plan, start)
        record = self._new_record(plan, start)
        t1 = time.perf_counter()
        record.timings["schedule"] = (t0, t1)
        if plan.seqs:
            output = self.runner.execute(plan)  # 2. one forward pass, one token per finished prefill/decode
            t2 = time.perf_counter()
            record.timings["forward"] = (t1, t2)  # (with packing and sampling: the host waits for it all)
            self._advance_clock(plan, t2 - t1)
            self._update(plan, output, record)  # (3. inside: update_from_output)
            record.timings["update"] = (t2, time.perf_counter())
        return self._close_record(record)

    def _new_record(self, plan, start: float) -> StepRecord:
        return new_record(self._num_steps, self.kv.kind, start, plan)

    def _advance_clock(self, plan, measured: float) -> None:
        if self.clock is not None:  # simulated time moves by the step's cost (cbteach.core.clock)
            if hasattr(self.clock, "advance_step"):
                self.clock.advance_step(plan, measured)
            else:
                self.clock.advance(measured)

    def _update(self, plan, output, record: StepRecord) -> None:
        """``update_from_output`` and what the engine keeps of it: completions, the step's record."""
        now = self.now()
        before = [len(s.output_ids) for s in plan.seqs]
        finished = self.scheduler.update_from_output(plan, output, now)  # 3. state moves
        if self._guard is not None:
            self._guard.after_update(plan, finished)
        for seq in finished:
            self._complete(seq, now)
        fill_record(record, plan, output, plan.kinds, before, finished)
        count_speculation(self.spec_stats, record)

    def _close_record(self, record: StepRecord) -> StepRecord:
        record.num_waiting = len(self.scheduler.waiting)
        if self.keep_records and self.kv.kind == "paged":
            record.kv_usage = self.kv.usage()
        record.duration = self.now() - record.start_time
        self._last_idle = record.idle
        if not record.idle:  # an idle step (waiting for arrivals) leaves no trace in the history
            record.step = self._num_steps
            self._num_steps += 1
            if self.keep_records:
                self.records.append(record)
        return record

    def wait_for_arrival(self) -> None:
        """Nothing could be scheduled: wait (sleep, or move a simulated clock) until the next request
        arrives or a handed-over request's K/V are ready. With nothing due later, work that cannot
        be scheduled is a scheduler bug: ``RuntimeError``, never a busy loop."""
        now = self.now()
        nxt = self.scheduler.next_event_time(now)
        if nxt is not None:
            if self.clock is not None:
                self.clock.advance(nxt - now)
            else:
                time.sleep(nxt - now)
        elif self.has_unfinished() and self._last_idle:  # (after a step that only preempted, step again)
            raise RuntimeError(f"the scheduler made no progress with {len(self.scheduler.running)} running, "
                               f"{len(self.scheduler.waiting)} waiting and {len(self.scheduler.swapped)} swapped-out "
                               "requests; please report this")

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
        while self.has_unfinished():
            record = self._step()
            if bar is not None:
                bar.update(sum(r.request_id in self.completions for r in requests) - bar.n)
            if record.idle:
                self.wait_for_arrival()
        if bar is not None:
            bar.close()
        return [self.completions[r.request_id] for r in requests]

    def stream(self, requests=()):
        """Add ``requests`` (validated as in :meth:`run`) and yield a
        :class:`~cbteach.engine.streaming.StreamEvent` per generated token, as soon as its step ends,
        until they are all done -- also requests added with :meth:`add_request` while streaming.
        Every request the stream covers ends with exactly one event carrying a ``finish_reason``,
        whoever drove the engine in between (another stream, :meth:`run`, :meth:`step`)."""
        self._check_open()
        return stream_events(self, self._add_all(requests))

    def abort(self, request_id) -> Completion:
        """Cancel a queued, running or swapped-out request -- all its samples, or one sample given its
        id ``(request_id, i)`` (vLLM's rule). Its KV blocks are freed at once, and its
        :class:`Completion` (``finish_reason="aborted"``, with what it generated so far) is returned."""
        try:
            seqs = self.groups.get(request_id) or [self.sequences[request_id]]
        except (TypeError, KeyError):
            raise ValueError(f"unknown request_id {request_id!r}: no such request was added to this engine") from None
        live = [s for s in seqs if not s.status.is_finished]
        if not live:
            raise ValueError(f"request {request_id!r} is already {seqs[0].status.value}; only a queued, running or "
                             "swapped-out request can be aborted")
        if self._stepper is not None:
            self._stepper.drain()  # the step in flight ends first: nobody is aborted half-way through one
        for seq in live:
            group = self.groups.get(seq.request.request_id, [seq])
            parallel_sampling.abort_sample(self.scheduler, seq, group)
            seq.finish_reason = "aborted"
            self._complete(seq, self.now())
        return self.completions.get(request_id) or seqs[0].completion

    def close(self) -> None:
        """Abort what is unfinished and let go of the KV memory and any worker processes; the engine
        cannot be used after this. ``with Engine(...) as eng:`` closes it at the end of the block."""
        if self._closed:
            return
        for seq in list(self.sequences.values()):
            if not seq.status.is_finished:
                self.abort(seq.request_id)
        self._closed = True
        if self._stepper is not None:
            self._stepper.close()
        self.runner.close()
        self.kv.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def sample_ids(self, request_id) -> list:
        """The sequence ids of a request: ``[request_id]``, or ``[(request_id, i) ...]`` for ``n > 1``."""
        group = self.groups.get(request_id)
        return [request_id] if group is None else [s.request_id for s in group]

    # -- internals ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("this engine was closed (Engine.close()); build a new one")
        check_unchanged(self._fingerprint, self.model, self.tokenizer)

    def _add_all(self, requests) -> list[Request]:
        requests = as_request_list(requests, "Engine.run() and Engine.stream()")
        taken: set = set()
        checked = []
        for r in requests:  # check them all before queuing any
            checked.append(self.check_request(r, taken))
            taken.update(_ids_of(r.request_id, r.sampling_params.n))
        t_run = self.now()
        for r, prompt_ids in zip(requests, checked):
            self._enqueue(r, prompt_ids, t_run + (r.arrival_time or 0.0), claimed=True)
        return requests

    def _enqueue(self, request: Request, prompt_ids: list[int], arrival_time: float, claimed: bool = False):
        mode = self.config.parallel_sampling
        seqs = parallel_sampling.make_samples(request, prompt_ids, arrival_time, claimed, mode)
        for seq in seqs:
            self.sequences[seq.request_id] = seq
        if len(seqs) > 1:
            self.groups[request.request_id] = seqs
        for seq in parallel_sampling.queued(seqs, mode):
            self.scheduler.add(seq)

    def _complete(self, seq: Sequence, now: float) -> None:
        seq.completion = Completion.of(seq, self.tokenizer, now)
        group = self.groups.get(seq.request.request_id)
        if group is None:
            self.completions[seq.request_id] = seq.completion
        elif all(s.completion is not None for s in group):  # the request is done when its last sample is
            self.completions[seq.request.request_id] = Completion.of_samples([s.completion for s in group], now)


def _ids_of(request_id, n: int) -> list:
    """The ids a request takes: its own, and ``(request_id, i)`` for each of ``n > 1`` samples."""
    return [request_id] if n == 1 else [request_id] + [(request_id, i) for i in range(n)]
