"""Sampling in the worker: one step's logits become tokens, first on the device, then on the host.

The worker samples (vLLM V1's workers each run the sampler), so the tokens need not be sent anywhere:
its batch appends its own, and the output tells the scheduler. Sampling has two halves, so that the
next step can start between them:

* :func:`sample_on_device` -- the tokens each row feeds next, as a tensor on the model's device
  (greedy rows: one ``max`` over the vocabulary; others: a draw with the request's generator), with a
  flag per row saying whether its logits were finite. The next step's input ids can be taken from
  this tensor directly (V1's ``prev_sampled_token_ids``);
* :meth:`DeviceSample.to_host` -- the copy to the host, as lists, for the scheduler's update.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.sampling import sample

NOT_FINITE = "the model produced logits that are not finite for this request"


@dataclass
class DeviceSample:
    """A step's sampled tokens, still on the device. ``tokens[i]``: what row ``i`` feeds next (0 where it
    samples nothing or failed: that output is dropped); ``finite[i]``: its logits were finite."""

    tokens: torch.Tensor
    finite: torch.Tensor
    errors: dict = field(default_factory=dict)  # row -> what went wrong when drawing its token

    def to_host(self) -> tuple[list, list]:
        """The device -> host copy: tokens and finite flags, as lists."""
        return self.tokens.tolist(), self.finite.tolist()


def sample_on_device(logits: torch.Tensor, params: list, generators: list) -> DeviceSample:
    """Sample each row of ``logits`` ``[rows, vocab]``: ``params[i]`` and ``generators[i]`` are row
    ``i``'s sampling parameters and generator (``None``: greedy; the global stream). A greedy batch
    never leaves the device here."""
    top, tokens = logits.max(dim=-1)  # (the first maximum, as argmax and generate take it)
    finite = torch.isfinite(top)
    out = DeviceSample(tokens=tokens, finite=finite)
    random_rows = [i for i, p in enumerate(params) if p is not None and not p.greedy]
    if random_rows:
        ok = finite.tolist()  # a draw from non-finite logits would fail anyway
        for i in random_rows:
            if ok[i]:
                try:
                    tokens[i] = sample(logits[i:i + 1], [params[i]], [generators[i]])[0]
                except (RuntimeError, ValueError) as err:
                    out.errors[i] = f"sampling failed: {err}"
    tokens.masked_fill_(~finite, 0)  # (no sync with the device: a failed row feeds 0, and is dropped)
    for i in out.errors:
        tokens[i] = 0
    return out
