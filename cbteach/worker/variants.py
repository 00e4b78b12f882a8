"""The model runner an engine's options need: V1's :class:`~cbteach.worker.model_runner.ModelRunner`,
with each variant's runner mixed in -- speculative guesses (:mod:`cbteach.worker.spec_runner`), V0's
swaps (:mod:`cbteach.worker.swap_runner`) and forks (:mod:`cbteach.worker.fork_runner`). Each lives
in a module of its own, imported only when an engine asks for it."""
from __future__ import annotations

from dataclasses import dataclass

from .model_runner import ModelRunner
from .step import Step


def runner_cls(swaps: bool = False, forks: bool = False, spec: bool = False) -> type:
    """The runner for a scheduler that sends guesses (``spec``), V0's swaps (``swaps``) and forks
    (``forks``). Mixed in this order: guesses are written after the batch has changed, swap-outs come
    before copies on write (a block a victim gave up may be a copy's destination)."""
    bases = []
    if spec:
        from .spec_runner import SpeculativeModelRunner
        bases.append(SpeculativeModelRunner)
    if swaps:
        from .swap_runner import SwappingModelRunner
        bases.append(SwappingModelRunner)
    if forks:
        from .fork_runner import ForkingModelRunner
        bases.append(ForkingModelRunner)
    if len(bases) < 2:
        return bases[0] if bases else ModelRunner
    name = "".join(b.__name__.removesuffix("ModelRunner") for b in bases)
    steps = tuple(b.step_cls for b in bases if b.step_cls is not Step)  # each variant's fields on one step
    attrs = {"step_cls": dataclass(type(name + "Step", steps, {}))} if len(steps) > 1 else {}
    return type(name + "ModelRunner", tuple(bases), attrs)
