"""The continuous-batching engine: iteration-level scheduling + ragged packing, one step at a time.

One call to :meth:`Engine.step` is one forward pass of the model, in three moves (vLLM V1's split):

1. ``plan = scheduler.schedule(now)`` -- who runs and how many tokens each feeds: sequences that
   finished last step are gone, queued requests fill their slots (Orca), a token budget may cut a
   long prompt into chunks (Sarathi-Serve), a full KV pool may preempt (PagedAttention/vLLM);
2. ``out = runner.execute(plan)`` -- pack those tokens into one ``[1, total_tokens]`` row, run the
   model once with the KV cache's help (``kv="concat"`` or ``kv="paged"``), sample a token for
   every sequence whose known tokens are now all computed;
3. ``scheduler.update_from_output(plan, out.sampled, now)`` -- the one place where
   ``num_computed_tokens`` and outputs change and where finished requests leave.

Greedy decoding in fp32 gives token for token what per-prompt ``model.generate`` gives when the
model's ``generation_config`` asks for plain greedy search (no repetition penalty and the like,
which the engine does not implement and warns about); the tests check exactly that against
transformers. (Different packing changes float rounding, so an exact tie between two logits could
in principle break the other way; the tests have never seen it in fp32. In bf16 or fp16 it is
common: see notebook 01's section on batch invariance.)

**Time.** The engine has a clock (:meth:`Engine.now`, seconds since the engine was created).
Every time in a :class:`~cbteach.request.Completion` is on it. A request's ``arrival_time`` of
``None`` means "when it is added"; a number means "not before": on the engine clock for
:meth:`add_request`, and relative to the start of the call for :meth:`run` (a trace replayed).
"""
from __future__ import annotations

import time

from . import modelinfo
from ..kv.concat import ConcatKVCache
from ..kv.paged import check_options as check_paged_options
from .model_runner import ModelRunner
from .records import SeqStep, StepRecord
from .request import Completion, Request, Sequence, as_request_list, validate_request
from .sampling import make_generator
from .policies import make_queue
from .speculative import count_speculation, make_proposer, propose_for
from ..serving.streaming import StreamEvent, stream_events  # noqa: F401  (StreamEvent: part of the engine's API)
from .scheduler import PREEMPTION_MODES, Scheduler, check_batch_size, check_token_budget

KV_KINDS = ("concat", "paged")
PAGED_OPTIONS = ("block_size", "num_blocks", "kv_memory_bytes", "bucket_shapes", "watermark", "prefix_caching",
                 "kv_dtype")


class Engine:
    """A small continuous-batching inference engine over a transformers causal LM.

    ``Engine(model, tokenizer, max_batch_size=8)`` keeps the concatenating KV cache;
    ``kv="paged"`` (with ``block_size``, ``num_blocks`` or ``kv_memory_bytes``) uses the paged one.
    ``token_budget`` caps the tokens of one step; longer prompts are then prefilled in chunks.
    ``policy`` is ``"fcfs"`` or ``"priority"`` (or a :class:`~cbteach.policies.WaitingQueue`);
    ``preemption`` is ``"recompute"`` or ``"swap"``; ``watermark`` (paged) is the fraction of blocks
    an admission leaves free. ``keep_records=False`` keeps no step history (long runs, benchmarks).
    """

    def __init__(self, model, tokenizer=None, *, max_batch_size: int, kv: str = "concat",
                 keep_records: bool = True, clock=None, **options):
        if kv not in KV_KINDS:
            raise ValueError(f"kv must be one of {KV_KINDS}, got {kv!r}")
        check_batch_size(max_batch_size)
        token_budget = options.pop("token_budget", None)
        check_token_budget(token_budget)
        queue = make_queue(options.pop("policy", "fcfs"))
        speculative = options.pop("speculative", None), options.pop("num_speculative_tokens", 3)
        preemption = options.pop("preemption", "recompute")
        if preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {preemption!r}")
        paged_args = {k: options.pop(k) for k in PAGED_OPTIONS if k in options}
        if options:
            raise ValueError(f"unknown engine option(s) {sorted(options)}; allowed: token_budget, policy, preemption, "
                             f"speculative, num_speculative_tokens, keep_records, and with kv='paged': {', '.join(PAGED_OPTIONS)}")
        check_paged_options(**paged_args)
        if kv == "concat" and paged_args.get("prefix_caching"):
            raise ValueError("prefix_caching needs kv='paged': blocks are what the prefix cache shares")
        if kv == "concat" and paged_args.get("kv_dtype") is not None:
            raise ValueError("kv_dtype needs kv='paged': the int8 pool is a paged pool")
        self.info = modelinfo.describe(model, tokenizer)  # refuses models the engine cannot run exactly
        self.proposer = make_proposer(*speculative, vocab_size=self.info.vocab_size)
        self.model = model  # each step runs it in eval mode (modelinfo.eval_mode) and leaves it as found
        self.tokenizer = tokenizer
        if kv == "paged":
            from ..kv.paged import PagedKVCache

            self.kv = PagedKVCache.for_model(self.info, max_batch_size=max_batch_size, **paged_args)
        else:  # valid paged-pool options are accepted and ignored, so one call can switch kv= back and forth
            self.kv = ConcatKVCache(self.info.num_layers, cache_kwarg=self.info.cache_kwarg,
                                    attn_implementation=self.info.attn_implementation, dtype=self.info.dtype)
        self.scheduler = Scheduler(max_batch_size, self.kv.manager, token_budget=token_budget,
                                   eos_ids=self.info.eos_ids, policy=queue, preemption=preemption,
                                   swapper=self.kv if kv == "paged" else None)
        self.runner = ModelRunner(self.model, self.info, self.kv)
        self.keep_records = bool(keep_records)
        self.records: list[StepRecord] = []
        self.completions: dict[object, Completion] = {}
        self.sequences: dict[object, Sequence] = {}  # every request ever added, by id
        self._num_steps = 0
        self.spec_stats = {"drafted": 0, "accepted": 0, "verify_steps": 0}  # speculative decoding
        self._t0 = time.perf_counter()
        self.clock = clock  # None: wall time; a VirtualClock: simulated time (see cbteach.serving.disagg)

    # -- public API --------------------------------------------------------------------------
    def now(self) -> float:
        """Seconds on the engine's clock (since the engine was created)."""
        return self.clock() if self.clock is not None else time.perf_counter() - self._t0

    def add_request(self, request: Request):
        """Validate and queue a request; returns its ``request_id``. Bad input raises ``ValueError``.

        An explicit ``arrival_time`` is a time on the engine's clock (:meth:`now`); ``None`` means now.
        """
        prompt_ids = self._check(request)
        at = self.now() if request.arrival_time is None else float(request.arrival_time)
        return self._enqueue(request, prompt_ids, at)

    @property
    def num_steps(self) -> int:
        """Forward steps run so far (idle waits for arrivals not counted), kept even without records."""
        return self._num_steps

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def kv_usage(self) -> dict:
        """The KV cache's state now (paged: blocks, tokens, utilisation, block tables, pool bytes)."""
        return self.kv.usage()

    def step(self) -> StepRecord:
        """Run one forward pass over everything scheduled and return what happened."""
        start = self.now()
        if self.proposer is not None:
            propose_for(self.scheduler.running, self.proposer)
        plan = self.scheduler.schedule(start)
        record = StepRecord(step=self._num_steps, kv_kind=self.kv.kind, start_time=start,
                            admitted=[s.request_id for s in plan.admitted],
                            preempted=[s.request_id for s in plan.preempted],
                            swapped_in=[s.request_id for s in plan.swapped_in])
        if plan.seqs:
            t_real = time.perf_counter()
            out = self.runner.execute(plan)
            if self.clock is not None:  # simulated time moves by what the step really took
                self.clock.advance(time.perf_counter() - t_real)
            now = self.now()
            kinds = [_kind(s, c, n) for s, c, n in zip(plan.seqs, plan.num_computed_tokens, plan.num_scheduled_tokens)]
            before = [len(s.output_ids) for s in plan.seqs]
            finished = self.scheduler.update_from_output(plan, out.sampled, now)
            for seq in finished:
                self._complete(seq, now)
            record.finished = [s.request_id for s in finished]
            record.seqs = [SeqStep(request_id=s.request_id, slot=s.slot, kind=k, num_computed_tokens=c,
                                   num_scheduled_tokens=n, token_ids=ch, sampled=s.output_ids[-1] if new else None,
                                   new_token_ids=s.output_ids[b:], num_draft_tokens=d,
                                   finish_reason=s.finish_reason if new else None)
                           for s, k, c, n, ch, new, d, b in zip(plan.seqs, kinds, plan.num_computed_tokens,
                                                                plan.num_scheduled_tokens, out.chunks, out.sampled,
                                                                out.num_draft_tokens, before)]
            count_speculation(self.spec_stats, record)
            record.forward_time = out.forward_time
            record.kv_bytes_copied, record.kv_bytes_read = out.traffic.bytes_copied, out.traffic.bytes_read
            record.kv_copy_time = out.traffic.seconds
        record.num_waiting = len(self.scheduler.waiting)
        if self.keep_records and self.kv.kind == "paged":
            record.kv_usage = self.kv.usage()
        record.duration = self.now() - start
        if plan.seqs:  # an idle step (waiting for arrivals) leaves no trace in the history
            self._num_steps += 1
            if self.keep_records:
                self.records.append(record)
        return record

    def run(self, requests, progress: bool = False) -> list[Completion]:
        """Add ``requests``, step until all are done, and return their completions in request order.

        An explicit ``arrival_time`` counts seconds from the start of this call. All requests are
        validated before any is queued, so a bad one raises ``ValueError`` and leaves the engine as
        it was.
        """
        requests = self._add_all(requests)
        ours = {r.request_id for r in requests}
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(requests), desc="requests", unit="req")
        with self.serving():
            while self.has_unfinished():
                record = self.step()
                if bar is not None:
                    bar.update(sum(1 for rid in record.finished if rid in ours))
                if not record.seqs:
                    self._wait_for_arrival()
        if bar is not None:
            bar.close()
        return [self.completions[r.request_id] for r in requests]

    def serving(self):
        """A context for many :meth:`step` calls in a row: the paged cache switches the model's attention
        once for the whole block (each step inside finds it switched) instead of once per step, and
        restores it when the block ends, however it ends. :meth:`run` uses it."""
        return self.kv.attention(self.model)

    def stream(self, requests=()):
        """Add ``requests`` (validated as in :meth:`run`) and yield a
        :class:`~cbteach.serving.streaming.StreamEvent` per generated token, as soon as its step ends, until
        nothing is left -- also requests added or aborted while streaming. The model is its own again
        between events."""
        return stream_events(self, self._add_all(requests))

    def abort(self, request_id) -> Completion:
        """Cancel a queued, running or swapped-out request: its KV blocks are freed at once, and its
        :class:`Completion` (``finish_reason="aborted"``, with what it generated so far) is returned."""
        try:
            seq = self.sequences.get(request_id)
        except TypeError:
            seq = None
        if seq is None:
            raise ValueError(f"unknown request_id {request_id!r}: no such request was added to this engine")
        if seq.status.is_finished:
            raise ValueError(f"request {request_id!r} is already {seq.status.value}; only a queued, running or "
                             "swapped-out request can be aborted")
        self.scheduler.abort(seq)
        seq.finish_reason = "aborted"
        self._complete(seq, self.now())
        return self.completions[request_id]

    # -- internals ---------------------------------------------------------------------------
    def _check(self, request, taken=()) -> list[int]:
        """Everything that can be wrong with a request, found before it touches the engine."""
        prompt_ids = validate_request(request, tokenizer=self.tokenizer, vocab_size=self.info.vocab_size,
                                      max_pos=self.info.max_positions)
        if request.request_id in self.sequences or request.request_id in taken:
            raise ValueError(f"duplicate request_id {request.request_id!r}: every request needs its own id")
        self.kv.check_fits(len(prompt_ids) + request.max_new_tokens, request.request_id)
        return prompt_ids

    def _add_all(self, requests) -> list[Request]:
        requests = as_request_list(requests, "Engine.run() and Engine.stream()")
        taken: set = set()
        checked = []
        for r in requests:  # check them all before queuing any
            checked.append(self._check(r, taken))
            taken.add(r.request_id)
        t_run = self.now()
        for r, prompt_ids in zip(requests, checked):
            self._enqueue(r, prompt_ids, t_run + (r.arrival_time or 0.0))
        return requests

    def _enqueue(self, request: Request, prompt_ids: list[int], arrival_time: float):
        seq = Sequence(request=request, prompt_ids=prompt_ids, arrival_time=arrival_time,
                       generator=make_generator(request.sampling_params))
        self.sequences[request.request_id] = seq
        self.scheduler.add(seq)
        return request.request_id

    def _wait_for_arrival(self):
        nxt = self.scheduler.next_arrival()
        now = self.now()
        if nxt is not None and nxt > now:  # nothing to do until the next request arrives
            if self.clock is not None:
                self.clock.advance(nxt - now)
            else:
                time.sleep(nxt - now)
        elif self.scheduler.running or self.scheduler.swapped:
            # Work is there and nothing could be scheduled: a scheduler bug, never a reason to spin.
            raise RuntimeError(f"the scheduler made no progress with {len(self.scheduler.running)} running and "
                               f"{len(self.scheduler.swapped)} swapped-out requests; please report this")

    def _complete(self, seq: Sequence, now: float) -> None:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        self.completions[seq.request_id] = Completion(
            request_id=seq.request_id, prompt_ids=list(seq.prompt_ids), output_ids=list(seq.output_ids),
            finish_reason=seq.finish_reason, text=text, arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time, token_times=list(seq.token_times), finish_time=now,
            num_cached_prompt_tokens=seq.num_cached_prompt_tokens)


def _kind(seq: Sequence, num_computed: int, num_scheduled: int) -> str:
    """"decode": it feeds the one token it sampled last step (plus any speculative guesses);
    "prefill": anything else (a prompt, a chunk of one, or recomputing after a preemption)."""
    return "decode" if num_computed == seq.num_tokens - 1 and seq.output_ids else "prefill"
