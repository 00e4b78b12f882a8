"""Speculative decoding on the worker's side: guesses fed after the known tokens, checked in one pass.

The scheduler's side (:mod:`cbteach.engine.speculative`) schedules a guessing request's guesses as
tokens to feed and sends them in the message (``scheduled_spec_decode_tokens``, V1's field). This
runner -- a :class:`~cbteach.worker.model_runner.ModelRunner` the executor builds only when the engine
speculates, in every tensor-parallel rank too -- writes them into the request's row after its known
tokens, keeps the logits of a guessing row's last ``1 + k`` positions, and checks the guesses
greedily (:func:`accept`): the model's argmax after each fed token, kept while it equals the next
guess. V1 checks them in its ``RejectionSampler`` (``vllm/v1/sample/rejection_sampler.py``), for
random requests too; here only greedy requests guess.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .model_runner import ModelRunner
from .step import NOT_FINITE, Step


@dataclass
class SpecStep(Step):
    """A step whose rows may feed guesses after their known tokens."""

    drafts: list = field(default_factory=list)  # each row's guesses (fed last)
    last: torch.Tensor | None = None  # [rows]: each row's last logit row among the kept ones
    targets: tuple | None = None  # (argmax, finite) of every kept logit row, on the device

    def row(self, i: int, **changes) -> SpecStep:
        return super().row(i, drafts=[self.drafts[i]], last=None, targets=None, **changes)


def accept(drafts: list[int], targets: list[int]) -> list[int]:
    """Greedy verification: ``targets[j]`` is the model's token after draft ``j`` (``targets[0]``
    after the last real token). Returns the tokens the step yields: the accepted drafts, then the
    model's own token at the first mismatch (or after the last draft)."""
    out = []
    for d, t in zip(drafts, targets):
        out.append(t)
        if d != t:
            return out
    out.append(targets[len(drafts)])
    return out


class SpeculativeModelRunner(ModelRunner):
    """A :class:`ModelRunner` that feeds and checks guesses (see the module)."""

    step_cls = SpecStep

    def update_states(self, msg) -> None:
        """As the runner's, then each guessing row's guesses after its known tokens, where the step's gather
        reads them (V1 writes them into ``token_ids_cpu`` the same way: ``vllm/v1/worker/gpu_input_batch.py``)."""
        super().update_states(msg)
        b = self.input_batch
        for rid, drafts in msg.scheduled_spec_decode_tokens.items():
            row = b.req_id_to_index[rid]
            b.append_token_ids(row, drafts)
            b.num_tokens[row] -= len(drafts)  # written where the gather reads them, not counted as known

    def build_inputs(self, step: SpecStep, block_tables, num_blocks=None) -> None:
        """As the runner's; a guessing row keeps the logits of its last ``1 + k`` tokens."""
        super().build_inputs(step, block_tables, num_blocks)
        spec = step.msg.scheduled_spec_decode_tokens
        step.drafts = [list(spec.get(rid, ())) for rid in step.req_ids]
        if any(step.drafts):
            ends = np.cumsum(step.counts).tolist()
            step.keep = torch.tensor([e - k for e, d in zip(ends, step.drafts) for k in range(len(d) + 1, 0, -1)],
                                     device=self.device)
            step.last = torch.tensor(np.cumsum([len(d) + 1 for d in step.drafts]) - 1, device=self.device)
            if self.accepts_logits_to_keep:
                step.kwargs["logits_to_keep"] = step.keep

    @torch.inference_mode()
    def sample(self, step: SpecStep) -> None:
        """Every kept row's argmax (the check), then each row samples from its last logits."""
        if step.last is not None:
            top, targets = step.logits.max(dim=-1)
            step.targets = (targets, torch.isfinite(top))
            step.logits = step.logits[step.last]
        super().sample(step)

    def sampled_tokens(self, step: SpecStep) -> tuple[list, list]:
        """As the runner's; a guessing row's tokens are its accepted guesses and one of the model's own."""
        sampled, errors = super().sampled_tokens(step)
        if step.targets is None:
            return sampled, errors
        targets, finite = (t.tolist() for t in step.targets)
        first = 0
        for i, drafts in enumerate(step.drafts):
            if drafts:
                block = slice(first, first + len(drafts) + 1)
                ok = all(finite[block])
                sampled[i], errors[i] = (accept(drafts, targets[block]), None) if ok else (None, NOT_FINITE)
            first += len(drafts) + 1
        return sampled, errors
