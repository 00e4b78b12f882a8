"""Parallel sampling by fork on the worker's side (``parallel_sampling="fork"``): copies on write, and
each prompt's samples drawing their first tokens from its logits.

The scheduler's side (:mod:`cbteach.engine.fork`) sends V0's message
(:class:`~cbteach.engine.scheduler_v0.V0SchedulerOutput`) with two more fields, and this runner --
a :class:`~cbteach.worker.model_runner.ModelRunner` the executor builds only for fork, in every
tensor-parallel rank too -- carries them out:

* ``block_copies`` -- ``(src, dst)`` pairs: a sample about to write into a block it shares got a
  fresh block, which must hold the shared one's K/V first. They are copied before the batch changes
  and before the forward pass (V0's ``blocks_to_copy``; V1's ``_update_states`` runs its own
  ``kv_cache_block_copies`` early too, after it forgets the finished requests), after any swap-out (a
  block a victim gave up may be a copy's destination);
* ``scheduled_forks`` -- ``{prompt id: [(sample id, sample index)]}`` with the step that ends a
  prompt: each sample gets a state of its own (the prompt's tokens, its own generator, seeded with
  ``seed + sample_index``), made once, and draws its first token from the prompt's last logit row,
  right after the batch's own sampling (so unseeded draws take the global stream in the same order on
  every rank). The tokens go back to the scheduler as ``fork_tokens`` (:class:`ForkRunnerOutput`);
  a failed draw fails the prompt it shares.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.scheduler_output import RunnerOutput
from ..core.sampling import make_generator, sample
from ..kv.fork import copy_blocks as copy_pool_blocks
from .input_batch import CachedRequestState
from . import recovery
from .model_runner import ModelRunner
from .step import Step


@dataclass
class ForkRunnerOutput(RunnerOutput):
    """A step's results with ``fork_tokens[i]``: ``{sample id: first token}`` of the samples forking from
    request ``i``, or ``None`` (and the whole list ``None`` when nobody forked)."""

    fork_tokens: list | None = None


@dataclass
class ForkStep(Step):
    """A step whose prompts may end with samples forking from them."""

    forks: dict = field(default_factory=dict)  # row -> [(sample id, generator)]: the samples forking from its prompt
    fork_tokens: dict = field(default_factory=dict)  # row -> {sample id: first token}, once sampled

    def row(self, i: int, **changes) -> ForkStep:
        return super().row(i, forks={0: self.forks[i]} if i in self.forks else {}, fork_tokens={}, **changes)

    def take_row(self, i: int, one: ForkStep) -> None:
        """Row ``i``, run again alone: its samples' first tokens are the ones drawn then."""
        self.fork_tokens[i] = one.fork_tokens.get(0, {})


class ForkingModelRunner(ModelRunner):
    """A :class:`ModelRunner` that copies blocks on write and samples the forks (see the module)."""

    step_cls = ForkStep

    def changes_pool_first(self, msg) -> bool:
        """The message's copies on write are made inside the pool before the batch changes."""
        return bool(msg.block_copies)

    def prepare_again(self, msg, first: ForkStep) -> ForkStep:
        """As the runner's, keeping the forked samples ``first`` made (once: their states exist now)."""
        step = super().prepare_again(msg, first)
        step.forks = first.forks
        return step

    def update_states(self, msg) -> None:
        """The message's copies on write first, then the batch as V1 changes it."""
        if msg.block_copies:
            self.copy_blocks(msg.block_copies)
        super().update_states(msg)

    def copy_blocks(self, copies: list) -> None:
        """Copies on write ``(src, dst)``, made before anyone writes; a copy takes over what its source
        holds, written or not."""
        copy_pool_blocks(self.kv_cache.pool, list(copies))
        for src, dst in copies:
            if src in self.unwritten_blocks:
                self.unwritten_blocks.add(dst)

    def _sampling_inputs(self, step: ForkStep) -> None:
        """As the runner's, and a prompt's forked samples: ``step.forks`` is ``{row: [(sample id,
        generator)]}``, a state and a generator each made here once (a sample already known is not
        forked again). A prompt's samples read its parameters, so a greedy batch keeps them too."""
        super()._sampling_inputs(step)
        step.forks = {}
        scheduled = step.msg.scheduled_forks
        if not scheduled:
            return
        b = self.input_batch
        step.params = [b.sampling_params[r] if s else None for r, s in zip(step.rows, step.samples)]
        step.generators = [b.generators.get(r) for r in step.rows]
        for i, rid in enumerate(step.req_ids):
            for sample_id, index in scheduled.get(rid, ()) if step.samples[i] else ():
                if sample_id not in self.requests:
                    parent = self.requests[rid]
                    self.requests[sample_id] = CachedRequestState(
                        req_id=sample_id, prompt_token_ids=list(parent.prompt_token_ids),
                        sampling_params=parent.sampling_params,
                        generator=make_generator(parent.sampling_params, index))
                    step.forks.setdefault(i, []).append((sample_id, self.requests[sample_id].generator))

    @torch.inference_mode()
    def sample(self, step: ForkStep) -> None:
        """The batch's tokens, then each forking sample's first token from its prompt's row
        (``step.fork_tokens``: ``{row: {sample id: token}}``)."""
        super().sample(step)
        step.fork_tokens = {}
        if not step.forks:
            return
        out = step.sampled
        rows = step.logits
        ok = out.finite.tolist()  # a draw from non-finite logits would fail anyway
        for i, picks in step.forks.items():
            drawn = {}
            for sample_id, generator in picks:
                if not ok[i]:
                    break
                try:
                    drawn[sample_id] = rows[i].argmax().item() if step.params[i].greedy else \
                        sample(rows[i:i + 1], [step.params[i]], [generator])[0]
                except (RuntimeError, ValueError) as err:
                    out.errors[i] = f"sampling failed: {err}"  # a fork's failure fails the prompt it shares
                    out.tokens[i] = 0
            step.fork_tokens[i] = drawn

    def finish(self, step: ForkStep) -> ForkRunnerOutput:
        """As the runner's, with each sampled prompt's samples' first tokens, which join their states."""
        out = super().finish(step)
        fork_tokens = [step.fork_tokens.get(i) if out.sampled[i] is not None else None for i in range(len(step.rows))]
        for forks in filter(None, fork_tokens):
            for sample_id, token in forks.items():
                self.requests[sample_id].output_token_ids.append(token)
        return ForkRunnerOutput(**vars(out), fork_tokens=fork_tokens if any(fork_tokens) else None)

    def join_outputs(self, req_ids: list, parts: list) -> ForkRunnerOutput:
        """The rows of a failed step, run alone, as one output again (:func:`recovery.join`), with each
        row's samples' first tokens."""
        out = recovery.join(req_ids, parts)
        fork_tokens = [(getattr(p, "fork_tokens", None) or [None])[0] for p in parts]
        return ForkRunnerOutput(**vars(out), fork_tokens=fork_tokens if any(fork_tokens) else None)
