"""Building an engine core from its options: which scheduler, KV cache, runner and step loop it runs.

The core's step (:mod:`cbteach.engine.engine_core`) is the same whatever the options; what they change
is which parts it is built from. Each variant is a part of its own, picked here and imported only when
asked for:

* the scheduler: vLLM V1's :class:`~cbteach.engine.scheduler.Scheduler`, or V0's rules
  (:class:`~cbteach.engine.scheduler_v0.V0Scheduler`); a learner's own must subclass the one the
  options need. Speculative decoding (:func:`~cbteach.engine.speculative.speculating`) and fork's
  parallel sampling (:func:`~cbteach.engine.fork.forking`) add their rules to it;
* the KV cache, with a learner's pieces plugged in (:mod:`cbteach.engine.plug`);
* the executor and its model runner, with the variants' runners mixed in (:mod:`cbteach.worker.variants`);
* the step loop: async scheduling's (:mod:`cbteach.engine.async_scheduling`), or the core's own;
* the rules a learner's scheduler is held to while it runs (:class:`~cbteach.engine.plug.RuleGuard`).
"""
from __future__ import annotations

from ..kv.probe import check_concat_runs, paged_shape
from ..core.model_view import model_view
from ..executor import make_executor
from ..kv.caches import make_kv_cache
from .plug import RuleGuard, plug_pieces
from .scheduler import Scheduler
from .scheduler_v0 import V0Scheduler, V0StepRecord, uses_v0_rules


def pick_scheduler_cls(config, scheduler_cls, proposer=None):
    """vLLM V1's :class:`Scheduler`, or :class:`V0Scheduler` when an option asks for a rule only V0 has;
    a scheduler of your own must be a subclass of the one the options need. ``parallel_sampling="fork"``
    adds fork's rules to it (:func:`cbteach.engine.fork.forking`), a ``proposer`` speculation's."""
    need = V0Scheduler if uses_v0_rules(config) else Scheduler
    cls = need if scheduler_cls is None else scheduler_cls
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        raise ValueError(f"scheduler_cls must be a subclass of cbteach.engine.scheduler.Scheduler, got {cls!r}")
    if not issubclass(cls, need):
        raise ValueError(f"preemption='swap', admission='whole_prompt', watermark and preempt_to_admit are vLLM V0's "
                         f"rules (current V1 has the middle two in its own form), which {cls.__name__} "
                         "does not have: subclass "
                         "cbteach.engine.scheduler_v0.V0Scheduler to use them")
    if config.parallel_sampling == "fork":
        from .fork import forking  # (imported only where it is used)

        cls = forking(cls)
    if proposer is not None:
        from .speculative import speculating

        cls = speculating(cls, proposer)
    return cls


def build_parts(core, model, tokenizer, scheduler_cls, kv_manager, attention, slot_mapping, update_batch) -> None:
    """Give ``core`` its parts for ``core.config``: ``kv``, ``scheduler``, ``executor``, ``rules`` and
    ``stepper`` (see the module)."""
    config, info = core.config, core.info
    proposer = None
    if config.speculative is not None:
        from .speculative import make_proposer  # (imported only where it is used)

        proposer = make_proposer(config.speculative, config.num_speculative_tokens, vocab_size=info.vocab_size)
    sched_cls = pick_scheduler_cls(config, scheduler_cls, proposer)
    swaps = issubclass(sched_cls, V0Scheduler)  # V0's rules: the cache holds swapped-out blocks in host memory
    if swaps or config.parallel_sampling == "fork":  # V0's message: its records say who was swapped in
        core.record_cls = V0StepRecord
    if config.cache.kind == "paged":  # the pool's shape as the layers use it, or the reason they cannot use it
        core.info = info = paged_shape(model, info)
    else:
        check_concat_runs(model, info)
    core.kv = make_kv_cache(info, config, pieces=attention is not None or slot_mapping is not None, swaps=swaps)
    plug_pieces(core.kv, kv_manager=kv_manager, attention=attention, slot_mapping=slot_mapping)
    if kv_manager is not None and config.cache.prefix_caching and getattr(core.kv.manager, "prefix_cache", None) is None:
        raise ValueError("prefix_caching=True needs a KV manager that caches prefixes; the plugged-in kv_manager "
                         f"({getattr(kv_manager, '__name__', type(kv_manager).__name__)}) does not, and the run "
                         "would silently go without: drop prefix_caching or the kv_manager")
    core.scheduler = sched_cls(config.scheduler, core.kv.manager, eos_ids=info.eos_ids)
    core.executor = make_executor(model, model_view(model, core.kv.attn_implementation), info, core.kv, config,
                                  update_batch=update_batch, swaps=swaps,
                                  forks=config.parallel_sampling == "fork", spec=proposer is not None)
    core.rules = RuleGuard(core.scheduler, core.kv) if scheduler_cls not in (None, Scheduler, V0Scheduler) else None
    core.stepper = None
    if config.async_scheduling:
        from .async_scheduling import AsyncStepper  # (imported only where it is used)

        try:
            core.stepper = AsyncStepper(core)
        except Exception:
            core.executor.close()  # worker processes started for nothing
            raise
