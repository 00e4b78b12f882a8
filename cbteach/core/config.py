"""The engine's options, validated once, in one place.

``Engine(model, tok, max_batch_size=8, kv="paged", block_size=4, token_budget=32, ...)`` keeps its
keyword arguments -- they are what the notebooks teach -- and turns them into three frozen
dataclasses, checked when they are made:

* :class:`SchedulerConfig` -- who runs each step: the batch limit, the token budget, the waiting
  queue's policy, how to preempt, and which admission rule to follow;
* :class:`CacheConfig` -- where K/V live: the concatenating cache or the paged pool, and the pool's
  block size, size, dtype and prefix caching;
* :class:`EngineConfig` -- both, plus speculative decoding and whether to keep step records.

A bad value raises a ``ValueError`` that says what is allowed, before anything is built. Every
other part of the engine reads these objects and never re-checks them (nano-vllm's single
``Config``, vLLM's ``SchedulerConfig``/``CacheConfig``).
"""
from __future__ import annotations

import difflib
import math
import numbers
from dataclasses import dataclass, field, fields

from .validation import check_positive_int

KV_KINDS = ("concat", "paged")
PREEMPTION_MODES = ("recompute", "swap")
ADMISSION_RULES = ("per_chunk", "whole_prompt")
KV_DTYPES = (None, "int8", "int8_block")
PARALLEL_SAMPLING = ("fanout", "fork")
ENGINE_OPTIONS = ("speculative", "num_speculative_tokens", "parallel_sampling", "async_scheduling",
                  "tensor_parallel_size")
BUILD_OPTIONS = ("clock", "scheduler_cls", "kv_manager", "attention", "slot_mapping", "update_batch")  # the engine's own
POLICY_NAMES = ("fcfs", "priority")  # cbteach.engine.policies.POLICIES, named here so configs import no engine
# The most sequences in one batch. The worker keeps a row per slot (tokens, block table), allocated when the engine
# is built; 10**9 slots asked for terabytes. vLLM's max_num_seqs is 256 to 1,024 on a GPU.
MAX_BATCH_SIZE = 65536


def check_batch_size(name: str, value) -> None:
    """``value`` slots: an integer from 1 to :data:`MAX_BATCH_SIZE`."""
    check_positive_int(name, value)
    if value > MAX_BATCH_SIZE:
        raise ValueError(f"{name} must be at most {MAX_BATCH_SIZE:,} (each slot holds a row of the batch from the "
                         f"start), got {value:,}")


def check_watermark(watermark) -> None:
    """A watermark is a fraction of the pool in [0, 1) (vLLM V0's block manager keeps 0.01)."""
    if not isinstance(watermark, (int, float)) or isinstance(watermark, bool) or not 0 <= watermark < 1:
        raise ValueError(f"watermark must be a fraction of the pool in [0, 1), got {watermark!r}")


def check_policy(policy) -> None:
    """A policy is one of :data:`POLICY_NAMES` or a waiting queue of your own (an object or class with
    ``key`` and ``pick_victim``: :class:`cbteach.engine.policies.WaitingQueue` and its subclasses)."""
    if isinstance(policy, str) and policy in POLICY_NAMES:
        return
    if not isinstance(policy, str) and all(callable(getattr(policy, m, None)) for m in ("key", "pick_victim", "add")):
        return
    raise ValueError(f"policy must be one of {sorted(POLICY_NAMES)} or a cbteach.engine.policies.WaitingQueue, "
                     f"got {policy!r}")


def check_clock(clock):
    """``clock`` itself when it is None (wall time) or a clock -- called for the time in seconds, moved by
    ``advance(seconds)`` (:mod:`cbteach.core.clock`) -- else a ``ValueError``."""
    if clock is not None and not (callable(clock) and callable(getattr(clock, "advance", None))):
        raise ValueError(f"clock must be None (wall time) or a clock: an object called for the time in seconds, "
                         f"with advance(seconds) (cbteach.core.clock.VirtualClock), got {clock!r}")
    return clock


@dataclass(frozen=True)
class SchedulerConfig:
    """How :class:`~cbteach.engine.scheduler.Scheduler` plans a step.

    ``admission="per_chunk"`` (the default): a waiting request is let in when the KV manager gives room
    for the chunk it feeds this step -- vLLM V1's rule before ``scheduler_reserve_full_isl``. ``"whole_prompt"``: only
    when its whole prompt fits (plus any output a preempted request must recompute), even when the
    token budget feeds it in chunks -- vLLM V0's rule, and current V1's default in its own form:
    ``vllm/v1/core/sched/scheduler.py`` passes ``full_sequence_must_fit=
    self.scheduler_reserve_full_isl`` to ``allocate_slots``, and ``SchedulerConfig.scheduler_reserve_full_isl``
    is True by default (V1 checks the whole sequence fits but takes blocks for the chunk only; V0, and
    this option, reserve them). It admits fewer requests on a sliver of room; it does not protect a
    prefill -- a decoding neighbour's refused allocation can still preempt it half-way through.
    V0's rules run in :class:`~cbteach.engine.scheduler_v0.V0Scheduler`.
    """

    max_batch_size: int
    token_budget: int | None = None
    policy: object = "fcfs"  # "fcfs", "priority" or a WaitingQueue subclass instance
    preemption: str = "recompute"
    admission: str = "per_chunk"
    preempt_to_admit: bool = False  # V0's (and SGLang's) priority rule; V1 preempts only for running requests

    def __post_init__(self):
        check_batch_size("max_batch_size", self.max_batch_size)
        if self.token_budget is not None:
            check_positive_int("token_budget (or None)", self.token_budget)
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {self.preemption!r}")
        if self.admission not in ADMISSION_RULES:
            raise ValueError(f"admission must be 'per_chunk' (vLLM V1's rule before scheduler_reserve_full_isl) or 'whole_prompt' "
                             f"(vLLM V0's, close to current V1's default), got {self.admission!r}")
        check_policy(self.policy)
        if not isinstance(self.preempt_to_admit, bool):
            raise ValueError(f"preempt_to_admit must be True (vLLM V0's and SGLang's rule: an urgent waiting request "
                             f"may preempt less urgent running ones) or False (V1's), got {self.preempt_to_admit!r}")


@dataclass(frozen=True)
class CacheConfig:
    """Where the K/V live. ``kind="concat"`` ignores the paged-pool fields (but still checks them:
    a bad value is a mistake either way, and one call can then switch ``kv=`` back and forth).

    The pool holds ``num_blocks`` blocks of ``block_size`` tokens; give ``num_blocks``, or
    ``kv_memory_bytes`` to size it from a memory budget, or neither for enough room for
    ``max_batch_size`` sequences of the model's full length (capped at 4,096 positions each).
    ``watermark`` is a fraction of blocks an admission leaves free (vLLM V0's block manager keeps
    1%; later V1 versions have a ``watermark`` too, 0 by default, as ours). ``kv_dtype`` stores K/V as int8 (:mod:`cbteach.kv.int8`).
    ``bucket_shapes`` pads attention shapes to powers of two (default: on CUDA only).
    """

    kind: str = "concat"
    block_size: int = 16
    num_blocks: int | None = None
    kv_memory_bytes: float | None = None
    bucket_shapes: bool | None = None
    watermark: float = 0.0
    prefix_caching: bool = False
    kv_dtype: str | None = None

    def __post_init__(self):
        if self.kind not in KV_KINDS:
            raise ValueError(f"kv must be one of {KV_KINDS}, got {self.kind!r}")
        check_positive_int("block_size", self.block_size)
        if self.num_blocks is not None:
            check_positive_int("num_blocks", self.num_blocks)
        mem = self.kv_memory_bytes
        if mem is not None and (not isinstance(mem, numbers.Real) or isinstance(mem, bool)
                                or not math.isfinite(mem) or mem <= 0):
            raise ValueError(f"kv_memory_bytes must be None or a finite number of bytes > 0, got {mem!r}")
        if self.num_blocks is not None and mem is not None:
            raise ValueError("give num_blocks or kv_memory_bytes, not both")
        if self.bucket_shapes is not None and not isinstance(self.bucket_shapes, bool):
            raise ValueError(f"bucket_shapes must be None (on CUDA only), True or False, got {self.bucket_shapes!r}")
        if not isinstance(self.prefix_caching, bool):
            raise ValueError(f"prefix_caching must be True or False, got {self.prefix_caching!r}")
        check_watermark(self.watermark)
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be None (the model's dtype), 'int8' (a scale per token and head) or "
                             f"'int8_block' (a scale per block and head), got {self.kv_dtype!r}")
        if self.kind == "concat" and self.prefix_caching:
            raise ValueError("prefix_caching needs kv='paged': blocks are what the prefix cache shares")
        if self.kind == "concat" and self.kv_dtype is not None:
            raise ValueError("kv_dtype needs kv='paged': the int8 pool is a paged pool")

    def pool_num_blocks(self, max_positions: int | None, max_batch_size: int, bytes_per_block: float) -> int:
        """How many blocks the pool gets: ``num_blocks``, or what ``kv_memory_bytes`` holds at
        ``bytes_per_block``, or room for ``max_batch_size`` sequences of the model's length."""
        if self.num_blocks is not None:
            return self.num_blocks
        if self.kv_memory_bytes is not None:
            per_block = round(bytes_per_block)  # a whole number of bytes (block scales are 4 bytes per block)
            n = int(self.kv_memory_bytes // per_block)
            if n < 1:
                raise ValueError(f"kv_memory_bytes={self.kv_memory_bytes} holds no block of {self.block_size} tokens "
                                 f"({per_block} bytes each)")
            return n
        return max_batch_size * math.ceil(min(max_positions or 4096, 4096) / self.block_size)


@dataclass(frozen=True)
class EngineConfig:
    """Everything an :class:`~cbteach.engine.engine.Engine` is built from."""

    scheduler: SchedulerConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    speculative: object = None  # None, "ngram" or a draft model
    num_speculative_tokens: int = 3
    keep_records: bool = True
    parallel_sampling: str = "fanout"  # n > 1: V1's child requests, or "fork": PagedAttention's copy on write
    async_scheduling: bool = False  # plan step N+1 while step N's forward runs (vLLM V1's async_scheduling)
    tensor_parallel_size: int = 1  # worker processes the model is sharded over (cbteach.parallel)

    def __post_init__(self):
        check_positive_int("num_speculative_tokens", self.num_speculative_tokens)
        check_positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.parallel_sampling not in PARALLEL_SAMPLING:
            raise ValueError(f"parallel_sampling must be 'fanout' (vLLM V1: n child requests sharing full prompt "
                             f"blocks through the prefix cache) or 'fork' (PagedAttention and vLLM V0: samples fork "
                             f"from the computed prompt, copy on write), got {self.parallel_sampling!r}")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True or False, got {self.async_scheduling!r}")
        if isinstance(self.speculative, str) and not self.speculative.strip():
            raise ValueError("speculative must be None (no speculation), 'ngram' or a draft model (loaded: "
                             f"cbteach.load_model(name)[0]), got {self.speculative!r}")
        if self.cache.watermark and self.scheduler.admission != "whole_prompt":
            raise ValueError("watermark is kept only with admission='whole_prompt' here (vLLM V0's rule; vLLM V1 has "
                             "one too, 0 by default): the default per-chunk admission keeps no watermark")

    @classmethod
    def from_options(cls, *, max_batch_size, kv: str = "concat", keep_records: bool = True,
                     **options) -> EngineConfig:
        """The engine's keyword arguments, sorted into their configs; an unknown one is refused."""
        sched_names = {f.name for f in fields(SchedulerConfig)} - {"max_batch_size"}
        cache_names = {f.name for f in fields(CacheConfig)} - {"kind"}
        unknown = sorted(set(options) - sched_names - cache_names - set(ENGINE_OPTIONS))
        if unknown:
            known = [*sched_names, *cache_names, *ENGINE_OPTIONS, *BUILD_OPTIONS, "keep_records"]
            close = {u: difflib.get_close_matches(u, known, n=1, cutoff=0.6) for u in unknown}
            guess = "".join(f" (did you mean {m[0]!r} for {u!r}?)" for u, m in close.items() if m)
            raise ValueError(f"unknown engine option(s) {unknown}{guess}; allowed: {', '.join(sorted(sched_names))}, "
                             f"{', '.join(ENGINE_OPTIONS)}, keep_records, {', '.join(BUILD_OPTIONS)}, and with "
                             f"kv='paged': {', '.join(sorted(cache_names))}")
        sched = SchedulerConfig(max_batch_size=max_batch_size, **{k: v for k, v in options.items() if k in sched_names})
        cache = CacheConfig(kind=kv, **{k: v for k, v in options.items() if k in cache_names})
        if not isinstance(keep_records, bool):
            raise ValueError(f"keep_records must be True (keep every step's record: engine.records) or False, "
                             f"got {keep_records!r}")
        config = cls(scheduler=sched, cache=cache, keep_records=keep_records,
                     **{k: options[k] for k in ENGINE_OPTIONS if k in options})
        if config.speculative is None and "num_speculative_tokens" in options:  # (else silently unused)
            raise ValueError(f"num_speculative_tokens={options['num_speculative_tokens']!r} sets how many tokens "
                             "speculation guesses per step, and speculative is None (no speculation): give "
                             "speculative='ngram' or a draft model, or leave num_speculative_tokens out")
        return config
