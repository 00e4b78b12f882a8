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

It changes no request state: the scheduler's ``update_from_output`` does that, from the
:class:`~cbteach.core.outputs.RunnerOutput` returned here. **One request's failure is its own**: a
row whose sampling fails, or whose logits are not finite, gets an error instead of a token; if the
forward pass itself raises, each sequence is run alone to find whose tokens the model fails on
(paged K/V are written in place, so running a sequence again rewrites the same values). Breaking a
rule of the engine (:class:`~cbteach.errors.EngineRuleError`) is never one request's fault:
it stops the step.
"""
from __future__ import annotations

import itertools
import time

import torch

from ..core.outputs import RunnerOutput
from ..core.sampling import sample_rows
from ..core.scheduler_output import SchedulerOutput
from ..errors import EngineDeadError, EngineRuleError
from .speculative import accept

__all__ = ["ModelRunner", "RunnerOutput"]


class ModelRunner:
    """Runs a plan on ``model`` -- the engine's own view of the user's model
    (:func:`~cbteach.core.model_view.model_view`: same weights, eval mode, the KV cache's attention)."""

    def __init__(self, model, info, kv_cache):
        self.model, self.info, self.kv_cache = model, info, kv_cache

    def close(self) -> None:
        """Nothing to release in one process (the tensor-parallel runner stops its workers here)."""

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """Run ``plan``: :meth:`prepare`, :meth:`forward`, :meth:`finish`, with each request's failure its own."""
        try:
            return self._execute(plan)
        except (EngineRuleError, EngineDeadError):
            raise
        except Exception as err:  # noqa: BLE001  (the model failed on someone's tokens: find whose)
            if len(plan.seqs) == 1:
                return _failed(plan, f"the model failed on this request's tokens: {type(err).__name__}: {err}")
            return self._execute_one_by_one(plan)

    def _execute(self, plan: SchedulerOutput) -> RunnerOutput:
        step = self.prepare(plan)
        self.forward(step)
        return self.finish(plan, step)

    # -- the three parts of execute(), apart for async scheduling ------------------------------------
    def prepare(self, plan: SchedulerOutput, placeholders: dict | None = None) -> dict:
        """Pack the plan and build its metadata (host work, and the step's one copy to the device).
        ``placeholders``: for async scheduling, the token of each sequence whose last token the step
        before is sampling right now (``{sequence: token id}``) -- its K/V are computed in this step."""
        seqs, starts, counts, drafts = (plan.seqs, plan.num_computed_tokens, plan.num_scheduled_tokens,
                                        plan.num_draft_tokens)
        # Speculative decoding: a decode may feed guesses past its known tokens (seq.draft_ids).
        chunks = []
        for s, c, n, d in zip(seqs, starts, counts, drafts):
            end = c + n - d
            chunk = s.token_ids(c, min(end, s.num_tokens))
            if end > s.num_tokens:  # the token the step in flight is sampling (async scheduling)
                chunk.append(placeholders[s])
            chunks.append(chunk + s.draft_ids[:d])
        meta = self.kv_cache.build_metadata([t for ch in chunks for t in ch], seqs, starts, counts, self.info.device)
        # Logits of each sequence's last token -- and of every fed token of a speculative one.
        num_logits = [n if d else 1 for n, d in zip(counts, drafts)]
        rows = self._logit_rows(meta, counts, num_logits, any(drafts))
        kwargs = self.kv_cache.forward_kwargs(meta)
        if self.info.accepts_logits_to_keep:
            kwargs["logits_to_keep"] = rows
        return {"chunks": chunks, "meta": meta, "kwargs": kwargs, "rows": rows,
                "first_row": [0, *itertools.accumulate(num_logits)]}  # sequence i's logits: first_row[i]:[i+1]

    @torch.inference_mode()
    def forward(self, step: dict) -> None:
        """The model, once (what async scheduling runs in its worker thread); fills ``step``."""
        meta, kwargs = step["meta"], step["kwargs"]
        t0 = time.perf_counter()
        out = self.model(input_ids=meta.input_ids, position_ids=meta.positions, **kwargs)
        step["forward_time"] = time.perf_counter() - t0
        step["traffic"] = self.kv_cache.after_forward(meta)
        step["logits"] = out.logits[0] if self.info.accepts_logits_to_keep else out.logits[0, step["rows"]]

    def finish(self, plan: SchedulerOutput, step: dict) -> RunnerOutput:
        """Sample from the step's logits: the :class:`RunnerOutput` the scheduler updates from."""
        sampled, fork_tokens, errors = self._sample(step["logits"], plan, step["first_row"])
        return RunnerOutput(sampled=sampled, chunks=step["chunks"], forward_time=step["forward_time"],
                            traffic=step["traffic"], fork_tokens=fork_tokens,
                            errors=errors if any(e is not None for e in errors) else None)

    def _execute_one_by_one(self, plan: SchedulerOutput) -> RunnerOutput:
        """The forward pass raised: run each sequence alone; the ones the model fails on get an error.

        Alone, a sequence no longer shares the pass with those before it. With prefix caching that
        matters: an admission may have found, as its cached prefix, blocks that an earlier sequence of
        this very step was to fill (they are findable from their allocation on, and in one pass they are
        written, layer by layer, before they are read). If that sequence failed, they were never
        written -- so the later one computes them itself, from the first unwritten block on: the same
        tokens at the same positions give the same K/V, and its answer stays exact."""
        parts = []
        unwritten: set = set()  # blocks this step was to fill for a sequence that failed
        for i, seq in enumerate(plan.seqs):
            sub = plan.subset([i])
            # (Only an admission finds a cached prefix in this step's blocks; it feeds no speculative guesses.)
            start = self._redo_from(seq, plan.num_computed_tokens[i], unwritten)
            if start is not None and not plan.num_draft_tokens[i]:
                sub.num_scheduled_tokens[0] += sub.num_computed_tokens[0] - start
                sub.num_computed_tokens[0] = start
            written = self._blocks_of(seq, sub.num_computed_tokens[0], sub.num_scheduled_tokens[0])
            try:
                parts.append(self._execute(sub))
                unwritten.difference_update(written)
            except (EngineRuleError, EngineDeadError):
                raise
            except Exception as err:  # noqa: BLE001
                unwritten.update(written)
                parts.append(_failed(sub, f"the model failed on this request's tokens: {type(err).__name__}: {err}"))
        return RunnerOutput(
            sampled=[p.sampled[0] for p in parts], chunks=[p.chunks[0] if p.chunks else [] for p in parts],
            forward_time=sum(p.forward_time for p in parts), traffic=next((p.traffic for p in parts if p.traffic), None),
            fork_tokens=[p.fork_tokens[0] if p.fork_tokens else None for p in parts],
            errors=[p.error(0) for p in parts])

    def _blocks_of(self, seq, start: int, count: int) -> list:
        """The blocks of ``seq`` that tokens ``start .. start + count - 1`` are written into (paged caches)."""
        size = getattr(self.kv_cache, "block_size", None)
        if size is None or count <= 0:
            return []
        return seq.block_table[start // size:(start + count - 1) // size + 1]

    def _redo_from(self, seq, computed: int, unwritten: set) -> int | None:
        """Where ``seq`` must start computing so that it reads no block in ``unwritten`` (``None``: it reads none)."""
        if not unwritten:
            return None
        reads = self._blocks_of(seq, 0, computed)
        first = next((k for k, block in enumerate(reads) if block in unwritten), None)
        return None if first is None else first * self.kv_cache.block_size

    def _logit_rows(self, meta, counts, num_logits, speculative: bool) -> torch.Tensor:
        """Packed rows whose logits we need: each sequence's last (``meta.logits_indices``), or, in a
        step with speculative guesses, every fed row of a speculating sequence (a second, small copy)."""
        if not speculative:
            return meta.logits_indices
        ends = itertools.accumulate(counts)
        return torch.tensor([i for e, k in zip(ends, num_logits) for i in range(e - k, e)], device=self.info.device)

    def _sample(self, logits, plan: SchedulerOutput, first_row: list[int]) -> tuple[list, list, list]:
        """One new token per sequence whose known tokens are now all computed (``None`` for a prefill
        chunk that stopped short); a speculating sequence keeps the guesses the model agrees with. A
        prompt with parallel samples waiting to fork from it gives each its own first token, drawn
        from the same logits with the sample's own generator (the prompt is computed once). A row
        that cannot be sampled gets an error instead."""
        seqs = plan.seqs
        sampled: list = [None] * len(seqs)
        fork_tokens: list = [None] * len(seqs)
        errors: list = [None] * len(seqs)
        plain = [i for i, (s, c, n, d) in enumerate(zip(seqs, plan.num_computed_tokens, plan.num_scheduled_tokens,
                                                         plan.num_draft_tokens)) if not d and c + n >= s.num_tokens]
        if plain:
            rows = [(i, s) for i in plain for s in [seqs[i], *seqs[i].forks]]  # forks: one row each, same logits
            picked, row_errors = sample_rows(logits[[first_row[i + 1] - 1 for i, _ in rows]],
                                             [s.request.sampling_params for _, s in rows], [s.generator for _, s in rows])
            for (i, s), token, err in zip(rows, picked, row_errors):
                if err is not None:
                    errors[i] = errors[i] or err  # a fork's failure fails the prompt it shares
                elif s is seqs[i]:
                    sampled[i] = [token]
                else:
                    fork_tokens[i] = (fork_tokens[i] or []) + [token]
        for i, d in enumerate(plan.num_draft_tokens):
            if d:  # greedy verification of the guesses (drafts are only made for greedy requests)
                block = logits[first_row[i]:first_row[i + 1]]
                if not bool(torch.isfinite(block).all()):
                    errors[i] = "the model produced logits that are not finite for this request"
                    continue
                sampled[i] = accept(seqs[i].draft_ids[:d], block.argmax(dim=-1).tolist())
        return sampled, fork_tokens, errors


def _failed(plan: SchedulerOutput, message: str) -> RunnerOutput:
    """Every sequence of ``plan`` failed with ``message``."""
    n = len(plan.seqs)
    return RunnerOutput(sampled=[None] * n, chunks=[[] for _ in range(n)], fork_tokens=[None] * n,
                        errors=[message] * n)
