"""One step as the model runner runs it: which rows, from where, how many tokens, and what came of it."""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

# What a row that failed says (its error in the runner's output)
NOT_FINITE = "the model produced logits that are not finite for this request"
NOT_FINITE_KV = "the model produced keys and values that are not finite for this request"


@dataclass
class Step:
    """One step as the runner runs it: rows ``rows`` of the batch, in packed order. The per-row lists
    (``rows`` .. ``samples``, ``params``, ``generators``) are in that order; the tensors are packed."""

    msg: object  # the SchedulerOutput
    rows: list[int]
    req_ids: list
    starts: list[int]  # position of each row's first fed token
    counts: list[int]  # tokens fed
    samples: list[bool]  # whether the row gets a token (it reaches the end of its known tokens)
    input_ids: np.ndarray | None = None  # [num_tokens] the fed ids, on the host
    meta: object = None  # the attention metadata (cbteach.attention.metadata)
    kwargs: dict | None = None  # the model's keyword arguments
    keep: torch.Tensor | None = None  # packed positions whose logits the model returns
    logits: torch.Tensor | None = None  # [rows, vocab]: each row's last logits
    params: list | None = None  # each row's SamplingParams (None: greedy), taken when the step is prepared
    generators: list | None = None  # each row's generator, or None
    sampled: object = None  # the DeviceSample
    forward_time: float = 0.0
    traffic: object = None

    def row(self, i: int, **changes) -> Step:
        """Row ``i`` alone, as a step of its own, before its inputs are built."""
        cut = {name: [getattr(self, name)[i]] for name in ("rows", "req_ids", "starts", "counts", "samples", "params",
                                                          "generators")}
        return replace(self, **cut, meta=None, kwargs=None, keep=None, logits=None, sampled=None, forward_time=0.0,
                       traffic=None, **changes)

    def take_row(self, i: int, one: Step) -> None:
        """Row ``i`` ran again alone, as ``one`` (:func:`~cbteach.worker.recovery.note_rows`): keep what else
        it drew there (nothing here; a subclass's own draws)."""
