"""The engine core: the step loop -- schedule, execute, update -- and nothing about taking requests in.

As in vLLM V1 (``EngineCore``, ``vllm/v1/engine/core.py``), the core owns the scheduler, the KV cache and
the executor, and :class:`~cbteach.engine.engine.Engine` adds the request API on top. One
:meth:`EngineCore.step` is one forward pass: ``scheduler.schedule`` (a message), ``executor.execute_model``
(the worker's model runner), ``scheduler.update_from_output``. After the last request finishes, one more
step tells the worker who finished (:meth:`~EngineCore.has_requests`), so it holds nothing when idle.
"""
from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass

from torch.nn.modules import module as torch_module

from ..core import modelinfo
from ..core.config import EngineConfig, check_clock
from ..core.records import StepRecord, fill_record
from ..core.request import Completion, Sequence
from ..errors import EngineClosedError, EngineDeadError
from .assemble import build_parts
from .fingerprint import check_unchanged, fingerprint


# cbteach's, not V1's (vLLM loads the weights itself): the model-changed check's cheap part
# (EngineCore.check_model). torch's registration hooks count the modules and parameters set on a watched
# model's modules -- a module replaced, an adapter added (none in a step: transformers' forward slices a
# ModuleList into a new one, which nobody watches).
_registrations = [0]
_watched: weakref.WeakSet = weakref.WeakSet()  # every module of every watched model (gone with the model)


def _count_registration(module, *_args) -> None:
    if type(module).__hash__ is not None and module in _watched:  # (a module class with __eq__, no __hash__: not ours)
        _registrations[0] += 1


def _watch(model) -> None:
    if not _registrations[0]:
        _registrations[0] = 1  # (hooked once per process)
        torch_module.register_module_module_registration_hook(_count_registration)
        torch_module.register_module_parameter_registration_hook(_count_registration)
    _watched.update(m for m in model.modules() if type(m).__hash__ is not None)


@dataclass
class PlannedStep:
    """A step as planned: the message, its live sequences in order, the tokens each had generated then
    (in-flight ones included: what tells a decode from a prefill in its record), the record."""

    plan: object  # the SchedulerOutput
    seqs: list[Sequence]
    num_generated: list[int]
    record: StepRecord


class EngineCore:
    """The scheduler, the KV cache, the executor and the step that drives them (build an ``Engine``)."""

    record_cls = StepRecord  # what a step's record is (a subclass may carry more)

    def __init__(self, model, tokenizer=None, *, max_batch_size: int, kv: str = "concat",
                 keep_records: bool = True, clock=None, scheduler_cls=None, kv_manager=None, attention=None,
                 slot_mapping=None, update_batch=None, **options):
        self.config = EngineConfig.from_options(max_batch_size=max_batch_size, kv=kv, keep_records=keep_records,
                                                **options)
        self.info = modelinfo.describe(model, tokenizer)  # refuses models the engine cannot run exactly
        self.model = model  # never changed: the runner runs the engine's own view of it
        self.tokenizer = tokenizer
        build_parts(self, model, tokenizer, scheduler_cls, kv_manager, attention, slot_mapping, update_batch)
        self.keep_records = self.config.keep_records
        self.records: list[StepRecord] = []
        self.completions: dict[object, Completion] = {}
        self.sequences: dict[object, Sequence] = {}  # every sequence ever added, by id ((id, i) for samples)
        self.groups: dict[object, list[Sequence]] = {}  # requests with n > 1 samples: id -> its samples
        self._num_steps = 0
        self._last_idle = True  # whether the last step did nothing at all (see Engine.wait_for_arrival)
        self._last_start = math.inf  # the engine time the last step was planned at (none yet)
        self.forward_seconds = 0.0  # the model's forward passes, all steps together (the rest is host work)
        self._t0 = time.perf_counter()
        self.clock = check_clock(clock)  # None: wall time; a VirtualClock: simulated time (cbteach.core.clock)
        _watch(model)
        self._model_fingerprint = fingerprint(model, tokenizer)
        self._model_params = list(model.parameters())
        self._model_quick = self._quick_model_state()
        self._closed = False
        self._dead: EngineDeadError | None = None  # what stopped the engine (a worker process died)

    def now(self) -> float:
        """Seconds since the engine was created, on its clock."""
        return self.clock() if self.clock is not None else time.perf_counter() - self._t0

    # -- stepping ----------------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        """Steps run so far (idle waits for arrivals not counted), kept even without records."""
        return self._num_steps

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or (self.stepper is not None and self.stepper.in_flight)

    def has_requests(self) -> bool:
        """Something to step for: unfinished requests, or finished ones the worker has not been told of."""
        return self.has_unfinished() or self.scheduler.has_finished_requests()

    def kv_usage(self) -> dict:
        """The KV cache's state now."""
        return self.kv.usage()

    def step(self) -> StepRecord:
        """Run one forward pass over everything scheduled and return what happened."""
        self._check_open()
        return self._step()

    def _step(self) -> StepRecord:
        try:
            return self._step_once()
        except EngineDeadError as err:
            self._dead = err  # every later call raises it again: the workers are gone
            raise

    def _step_once(self) -> StepRecord:
        if self.stepper is not None:  # a variant's step loop of its own
            return self.stepper.step()
        start, t0 = self.now(), time.perf_counter()
        plan = self.scheduler.schedule(start)  # 1. who runs, how many tokens each: a message
        step = self.begin_step(plan, start)
        t1 = time.perf_counter()
        step.record.timings["schedule"] = (t0, t1)
        if plan.num_scheduled_tokens:
            output = self.executor.execute_model(plan)  # 2. one forward pass, one token per finished prefill/decode
            t2 = time.perf_counter()
            step.record.timings["forward"] = (t1, t2)  # (with packing and sampling: the host waits for it all)
            self.advance_clock(plan, t2 - t1)
            self.apply_output(step, output)  # (3. inside: update_from_output)
            step.record.timings["update"] = (t2, time.perf_counter())
        elif not plan.is_empty:
            self.executor.execute_model(plan)  # nothing to run, but the worker forgets who finished, moves blocks
        return self.end_record(step.record)

    # -- the parts of a step (another step loop calls them in its own order) ---------------------------
    def begin_step(self, plan, start: float) -> PlannedStep:
        if self.rules is not None:
            self.rules.after_schedule(plan, start)
        seqs = [self.scheduler.requests[rid] for rid in plan.num_scheduled_tokens]
        generated = [s.num_generated for s in seqs]
        record = self.record_cls(step=self._num_steps, kv_kind=self.kv.kind, start_time=start, **plan.record_fields())
        return PlannedStep(plan, seqs, generated, record)

    def advance_clock(self, plan, measured: float) -> None:
        """A simulated clock moves by the step's cost; the wall clock moves by itself."""
        if self.clock is not None:
            if hasattr(self.clock, "advance_step"):
                self.clock.advance_step(plan, measured)
            else:
                self.clock.advance(measured)

    def apply_output(self, step: PlannedStep, output) -> None:
        """``update_from_output`` and what the engine keeps of it: completions, the step's record."""
        now = self.now()
        before = [len(s.output_ids) for s in step.seqs]
        finished = self.scheduler.update_from_output(step.plan, output, now)  # 3. state moves
        for seq in [*step.seqs, *finished]:  # (an update written elsewhere may free one without forget())
            if seq.status.is_finished and seq.request_id in self.scheduler.requests:
                self.scheduler.forget(seq)
        if self.rules is not None:
            self.rules.after_update(step.seqs, finished)
        for seq in finished:
            self._complete(seq, now)
        fill_record(step.record, step, output, before, finished, fed=self.keep_records)
        self.forward_seconds += output.forward_time

    def end_record(self, record: StepRecord) -> StepRecord:
        """Close a step's record: numbered and kept unless it was an idle wait."""
        record.num_waiting = len(self.scheduler.waiting)
        if self.keep_records and self.kv.kind == "paged":
            record.kv_usage = self.kv.usage()
        record.duration = self.now() - record.start_time
        self._last_idle = record.idle
        self._last_start = record.start_time
        if not record.idle:
            record.step = self._num_steps
            self._num_steps += 1
            if self.keep_records:
                self.records.append(record)
        return record

    # -- internals ---------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closed:
            raise EngineClosedError("this engine was closed (Engine.close()); build a new one")
        self.check_model()

    def check_model(self) -> None:
        """:class:`~cbteach.errors.ModelChangedError` if the model changed since the engine was built: a cheap
        comparison every step, the whole :func:`~cbteach.engine.fingerprint.fingerprint` when it differs."""
        if self._quick_model_state() != self._model_quick:
            check_unchanged(self._model_fingerprint, self.model, self.tokenizer)  # raises, naming what changed
            self._model_params = list(self.model.parameters())  # nothing the engine reads changed (a module set again)
            self._model_quick = self._quick_model_state()

    def _quick_model_state(self) -> tuple:
        params, gen = self._model_params, getattr(self.model, "generation_config", None)
        return (_registrations[0], tuple((p.data_ptr(), p._version) for p in params),  # (a new dtype: new storage)
                repr(getattr(gen, "eos_token_id", None)), repr(getattr(self.model.config, "eos_token_id", None)))

    def _complete(self, seq: Sequence, now: float) -> None:
        seq.completion = Completion.of(seq, self.tokenizer, now)
        group = self.groups.get(seq.request.request_id)
        if group is None:
            self.completions[seq.request_id] = seq.completion
        elif all(s.completion is not None for s in group):  # the request is done when its last sample is
            self.completions[seq.request.request_id] = Completion.of_samples([s.completion for s in group], now)
