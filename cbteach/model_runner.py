"""The model runner: execute one step's plan -- pack, run the model once, sample.

The scheduler decides *who* runs and *how many* tokens each feeds (a
:class:`~cbteach.scheduler.SchedulerOutput`); the runner turns that into one forward pass:

1. **pack** -- each sequence's scheduled tokens are concatenated into one ``[1, T]`` row, no padding
   (:mod:`cbteach.packing` explains why this works);
2. **metadata** -- the KV cache builds the step's :class:`~cbteach.attn_metadata.AttentionMetadata`
   (positions, query offsets, and for the paged cache the slot mapping and block tables), once;
3. **forward** -- the model runs with ``position_ids`` and whatever the cache adds: past keys and a
   4-D mask (concat) or the metadata for paged attention. ``logits_to_keep`` asks the model for the
   logits of each sequence's last token only;
4. **sample** -- a sequence whose known tokens are now all computed gets one new token
   (:mod:`cbteach.sampling`); a prefill chunk that stopped short gets ``None``.

It changes no request state: :meth:`~cbteach.scheduler.Scheduler.update_from_output` does that.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .sampling import sample
from .scheduler import SchedulerOutput


@dataclass
class RunnerOutput:
    sampled: list  # per scheduled sequence: the new token id, or None for a partial prefill chunk
    chunks: list  # per scheduled sequence: the token ids it fed
    forward_time: float
    traffic: object  # the KV cache's KVTraffic for this step


class ModelRunner:
    def __init__(self, model, info, kv):
        self.model, self.info, self.kv = model, info, kv

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        seqs = plan.seqs
        chunks = [s.token_ids(c, c + n) for s, c, n in zip(seqs, plan.num_computed_tokens, plan.num_scheduled_tokens)]
        meta = self.kv.build_metadata([t for ch in chunks for t in ch], seqs, plan.num_computed_tokens,
                                      plan.num_scheduled_tokens, self.info.device)
        kwargs = self.kv.forward_kwargs(meta)
        if self.info.accepts_logits_to_keep:
            kwargs["logits_to_keep"] = meta.logits_indices
        t0 = time.perf_counter()
        with self.kv.attention(self.model):
            out = self.model(input_ids=meta.input_ids, position_ids=meta.positions, **kwargs)
        forward_time = time.perf_counter() - t0
        traffic = self.kv.after_forward(meta)

        logits = out.logits[0] if self.info.accepts_logits_to_keep else out.logits[0, meta.logits_indices]
        done = [c + n == s.num_tokens for s, c, n in zip(seqs, plan.num_computed_tokens, plan.num_scheduled_tokens)]
        rows = [i for i, d in enumerate(done) if d]
        sampled: list = [None] * len(seqs)
        if rows:
            picked = sample(logits[rows] if len(rows) < len(seqs) else logits,
                            [seqs[i].request.sampling_params for i in rows], [seqs[i].generator for i in rows])
            for i, token in zip(rows, picked):
                sampled[i] = token
        return RunnerOutput(sampled=sampled, chunks=chunks, forward_time=forward_time, traffic=traffic)
