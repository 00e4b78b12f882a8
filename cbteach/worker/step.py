"""One step as the runner runs it, and the tokens it feeds before the host knows them.

Under async scheduling a step can be prepared before the step in front of it has finished: a decode
then feeds a token that exists only on the device (the last step's sample). The host fills its place
in the packed row with 0 and remembers it as *pending*; the device copy replaces the 0 before the
forward pass (:attr:`cbteach.worker.async_runner.AsyncModelRunner.prev`). V1 feeds the token the same way, from
``prev_sampled_token_ids`` (``gpu_model_runner.py``), but its worker keeps a placeholder (-1) where
that token goes and never learns it on the host -- which is *why* a request it must add to its batch
again comes with its token ids (``all_token_ids`` in the message). This worker writes the real token
into its rows and states once the step's output reaches the host.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Step:
    """One step as the runner runs it: rows ``rows`` of the batch, in packed order."""

    msg: object  # the SchedulerOutput
    rows: list[int]
    req_ids: list
    starts: list[int]  # position of each row's first fed token
    counts: list[int]  # tokens fed (known ones, then guesses)
    drafts: list[list[int]]  # speculative guesses fed after the known tokens
    samples: list[bool]  # whether the row gets a token (it reaches the end of its known tokens)
    input_ids: np.ndarray | None = None  # the host's copy of the fed ids (a pending token: 0)
    pending: list = field(default_factory=list)  # (packed position, request id, token position) not known then
    meta: object = None
    kwargs: dict | None = None
    keep: torch.Tensor | None = None  # packed rows whose logits the model returns
    last: torch.Tensor | None = None  # speculative steps: each row's last logit row among the kept ones
    logits: torch.Tensor | None = None
    params: list | None = None  # each row's SamplingParams (None: greedy), taken when the step is prepared
    generators: list | None = None  # each row's generator, or None
    sampled: object = None  # the DeviceSample
    forward_time: float = 0.0
    traffic: object = None


def pending_tokens(req_ids, starts, counts, known_ends, input_ids) -> list:
    """Fed positions past what the host knows -- the token the last step sampled for the request (under
    async scheduling still on the device), or, if that step failed for it, none: fed as 0, its output
    dropped. Sets those places of ``input_ids`` to 0 and returns ``(packed position, request id, token
    position)`` for each."""
    if not np.any(np.add(starts, counts) > known_ends):
        return []
    out, pos = [], 0
    for rid, start, count, known in zip(req_ids, starts, counts, known_ends):
        for p in range(max(start, int(known)), start + count):
            input_ids[pos + p - start] = 0
            out.append((pos + p - start, rid, p))
        pos += count
    return out
