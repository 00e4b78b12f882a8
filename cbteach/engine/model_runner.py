"""The model runner: execute one step's plan -- pack, run the model once, sample.

The scheduler decides *who* runs and *how many* tokens each feeds (a
:class:`~cbteach.core.scheduler_output.SchedulerOutput`); the runner turns that into one forward pass:

1. **pack** -- each sequence's scheduled tokens are concatenated into one ``[1, T]`` row, no padding
   (:mod:`cbteach.attention.packing` explains why this works);
2. **metadata** -- the KV cache builds the step's :class:`~cbteach.attention.metadata.AttentionMetadata`
   (positions, query offsets, and for the paged cache the slot mapping and block tables), once;
3. **forward** -- the model runs with ``position_ids`` and whatever the cache adds: past keys and a
   4-D mask (concat) or the metadata for paged attention. ``logits_to_keep`` asks the model for the
   logits of each sequence's last token only;
4. **sample** -- a sequence whose known tokens are now all computed gets one new token
   (:mod:`cbteach.core.sampling`); a prefill chunk that stopped short gets ``None``. A sequence that
   fed speculative guesses gets every guess the model agrees with plus one token of its own
   (:mod:`cbteach.engine.speculative`).

It changes no request state: :meth:`~cbteach.engine.scheduler.Scheduler.update_from_output` does that.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from ..core.sampling import sample
from ..core.scheduler_output import SchedulerOutput
from .speculative import accept


@dataclass
class RunnerOutput:
    sampled: list  # per scheduled sequence: its new token ids (several after speculation), or None
    chunks: list  # per scheduled sequence: the token ids it fed (guesses included)
    forward_time: float
    traffic: object  # the KV cache's KVTraffic for this step
    fork_tokens: list  # per scheduled sequence: first tokens of the samples forking from it (n > 1), or None


class ModelRunner:
    """Runs a plan on ``model`` -- the engine's own view of the user's model
    (:func:`~cbteach.core.model_view.model_view`: same weights, eval mode, the KV cache's attention)."""

    def __init__(self, model, info, kv_cache):
        self.model, self.info, self.kv_cache = model, info, kv_cache

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        seqs, starts, counts, drafts = (plan.seqs, plan.num_computed_tokens, plan.num_scheduled_tokens,
                                        plan.num_draft_tokens)
        # Speculative decoding: a decode may feed guesses past its known tokens (seq.draft_ids).
        chunks = [s.token_ids(c, c + n - d) + s.draft_ids[:d] for s, c, n, d in zip(seqs, starts, counts, drafts)]
        meta = self.kv_cache.build_metadata([t for ch in chunks for t in ch], seqs, starts, counts, self.info.device)
        # Logits of each sequence's last token -- and of every fed token of a speculative one.
        num_logits = [n if d else 1 for n, d in zip(counts, drafts)]
        first_row = [0, *itertools.accumulate(num_logits)]  # sequence i's logits: rows first_row[i]:first_row[i+1]
        rows = self._logit_rows(meta, counts, num_logits, any(drafts))
        kwargs = self.kv_cache.forward_kwargs(meta)
        if self.info.accepts_logits_to_keep:
            kwargs["logits_to_keep"] = rows
        t0 = time.perf_counter()
        out = self.model(input_ids=meta.input_ids, position_ids=meta.positions, **kwargs)
        forward_time = time.perf_counter() - t0
        traffic = self.kv_cache.after_forward(meta)
        logits = out.logits[0] if self.info.accepts_logits_to_keep else out.logits[0, rows]
        sampled, fork_tokens = self._sample(logits, plan, first_row)
        return RunnerOutput(sampled=sampled, chunks=chunks, forward_time=forward_time, traffic=traffic,
                            fork_tokens=fork_tokens)

    def _logit_rows(self, meta, counts, num_logits, speculative: bool) -> torch.Tensor:
        """Packed rows whose logits we need: each sequence's last (``meta.logits_indices``), or, in a
        step with speculative guesses, every fed row of a speculating sequence (a second, small copy)."""
        if not speculative:
            return meta.logits_indices
        ends = itertools.accumulate(counts)
        return torch.tensor([i for e, k in zip(ends, num_logits) for i in range(e - k, e)], device=self.info.device)

    def _sample(self, logits, plan: SchedulerOutput, first_row: list[int]) -> tuple[list, list]:
        """One new token per sequence whose known tokens are now all computed (``None`` for a prefill
        chunk that stopped short); a speculating sequence keeps the guesses the model agrees with. A
        prompt with parallel samples waiting to fork from it gives each its own first token, drawn
        from the same logits with the sample's own generator (the prompt is computed once)."""
        seqs = plan.seqs
        sampled: list = [None] * len(seqs)
        fork_tokens: list = [None] * len(seqs)
        plain = [i for i, (s, c, n, d) in enumerate(zip(seqs, plan.num_computed_tokens, plan.num_scheduled_tokens,
                                                         plan.num_draft_tokens)) if not d and c + n == s.num_tokens]
        if plain:
            rows = [(i, s) for i in plain for s in [seqs[i], *seqs[i].forks]]  # forks: one row each, same logits
            picked = sample(logits[[first_row[i + 1] - 1 for i, _ in rows]], [s.request.sampling_params for _, s in rows],
                            [s.generator for _, s in rows])
            for (i, s), token in zip(rows, picked):
                if s is seqs[i]:
                    sampled[i] = [token]
                else:
                    fork_tokens[i] = (fork_tokens[i] or []) + [token]
        for i, d in enumerate(plan.num_draft_tokens):
            if d:  # greedy verification of the guesses (drafts are only made for greedy requests)
                targets = logits[first_row[i]:first_row[i + 1]].argmax(dim=-1).tolist()
                sampled[i] = accept(seqs[i].draft_ids[:d], targets)
        return sampled, fork_tokens
