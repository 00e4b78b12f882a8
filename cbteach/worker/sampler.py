"""Sampling in the worker: one step's logits become tokens, first on the device, then on the host.

Every rank samples (vLLM V1's workers each run the sampler, with the same seeded generators, on the
same logits: the tensor-parallel all-reduces leave every rank's logits equal), so the tokens need
not be sent anywhere -- each rank's batch appends its own, and only the output rank tells the
scheduler. Sampling has two halves, because under async scheduling the next step is launched
between them:

* :func:`sample_on_device` -- the tokens each row feeds next, as a tensor on the model's device
  (greedy rows: one ``max`` over the vocabulary; others: a draw with the request's generator), with a
  flag per row saying whether its logits were finite. The next step's input ids can be taken from
  this tensor directly (V1's ``prev_sampled_token_ids``);
* :meth:`DeviceSample.to_host` -- the copy to the host, as lists, for the scheduler's update.

:func:`accept` is speculative decoding's greedy verification (V1's rejection sampler, for greedy
requests): which guesses the model agrees with.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.sampling import sample

NOT_FINITE = "the model produced logits that are not finite for this request"


@dataclass
class DeviceSample:
    """A step's sampled tokens, still on the device. ``tokens[i]``: what row ``i`` feeds next (0 where it
    samples nothing or failed: that output is dropped); ``finite[i]``: its logits were finite;
    ``targets``: the argmax of every logit row (speculative verification), or ``None``."""

    tokens: torch.Tensor
    finite: torch.Tensor
    targets: torch.Tensor | None = None
    targets_finite: torch.Tensor | None = None
    errors: dict = field(default_factory=dict)  # row -> what went wrong when drawing its token

    def to_host(self) -> tuple:
        """The device -> host copy (one per tensor): tokens, finite flags, and (speculative steps)
        every logit row's argmax and finite flag."""
        if self.targets is None:
            return self.tokens.tolist(), self.finite.tolist(), None, None
        return self.tokens.tolist(), self.finite.tolist(), self.targets.tolist(), self.targets_finite.tolist()


def sample_on_device(logits: torch.Tensor, last: torch.Tensor | None, params: list, generators: list) -> DeviceSample:
    """Sample each request's last logit row: rows ``last`` of ``logits`` (``None``: ``logits`` has one
    row per request; a step with speculative guesses has more, and their argmax are the ``targets``).
    ``params[i]`` and ``generators[i]`` are request ``i``'s sampling parameters and generator
    (``None``: the global stream). A greedy batch never leaves the device here."""
    top, tokens = logits.max(dim=-1)  # (the first maximum, as argmax and generate take it)
    finite = torch.isfinite(top)
    out = DeviceSample(tokens=tokens, finite=finite)
    rows = logits
    if last is not None:  # speculative guesses: every row's argmax verifies them
        out.targets, out.targets_finite = tokens, finite
        rows, tokens, finite = logits[last], tokens[last], finite[last]
        out.tokens, out.finite = tokens, finite
    random_rows = [i for i, p in enumerate(params) if p is not None and not p.greedy]
    if random_rows:
        ok = finite.tolist()  # a draw from non-finite logits would fail anyway
        for i in random_rows:
            if ok[i]:
                try:
                    tokens[i] = sample(rows[i:i + 1], [params[i]], [generators[i]])[0]
                except (RuntimeError, ValueError) as err:
                    out.errors[i] = f"sampling failed: {err}"
    tokens.masked_fill_(~finite, 0)  # (no sync with the device: a failed row feeds 0, and is dropped)
    for i in out.errors:
        tokens[i] = 0
    return out


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
