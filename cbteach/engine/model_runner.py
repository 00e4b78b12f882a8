"""The model runner: execute one step's plan -- pack, run the model once, sample.

The scheduler decides *who* runs and *how many* tokens each feeds, and sends it as a message (a
:class:`~cbteach.core.scheduler_output.SchedulerOutput`: plain data, no live request objects). The
runner first applies the message to its own **persistent batch**
(:class:`~cbteach.engine.input_batch.InputBatch`: token ids, block tables and random streams of the
requests it runs -- the only state it reads), then turns the step into one forward pass:

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

It changes no request state of the scheduler's: the scheduler's ``update_from_output`` does that,
from the :class:`~cbteach.core.outputs.RunnerOutput` returned here (the runner appends the tokens it
sampled to its own copy). **One request's failure is its own**: a
row whose sampling fails, or whose logits are not finite, gets an error instead of a token; if the
forward pass itself raises, each sequence is run alone to find whose tokens the model fails on
(paged K/V are written in place, so running a sequence again rewrites the same values); the blocks a
failed request was to fill are remembered as unwritten, and whoever reads them computes them again. Breaking a
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
from .input_batch import InputBatch, ScheduledRow
from .speculative import accept

__all__ = ["ModelRunner", "RunnerOutput"]


class ModelRunner:
    """Runs each step's message on ``model`` -- the engine's own view of the user's model
    (:func:`~cbteach.core.model_view.model_view`: same weights, eval mode, the KV cache's attention)."""

    def __init__(self, model, info, kv_cache):
        self.model, self.info, self.kv_cache = model, info, kv_cache
        self.input_batch = InputBatch(getattr(kv_cache, "block_size", None))

    def close(self) -> None:
        """Nothing to release in one process (the tensor-parallel runner stops its workers here)."""

    def generator_state(self, req_id) -> bytes | None:
        """A seeded request's random stream, as bytes (a disaggregated handover carries it along)."""
        return self.input_batch.generator_state(req_id)

    @torch.inference_mode()
    def execute(self, msg: SchedulerOutput) -> RunnerOutput:
        """Apply ``msg`` to the persistent batch, then run its rows: :meth:`prepare`, :meth:`forward`,
        :meth:`finish` -- with each request's failure its own."""
        return self.run(self.update_states(msg))

    def update_states(self, msg: SchedulerOutput) -> list[ScheduledRow]:
        """The message changes the persistent batch (V1's ``_update_states``); copy-on-write copies it
        asks for are made now, before anyone writes. Returns the step's rows."""
        rows = self.input_batch.update(msg)
        if msg.block_copies:
            self.kv_cache.copy_blocks(msg.block_copies)
        return rows

    def run(self, rows: list[ScheduledRow]) -> RunnerOutput:
        """Run a step's rows (already applied); if the forward pass raises, find whose tokens failed."""
        if not rows:
            return RunnerOutput(sampled=[], req_ids=[])
        try:
            return self._run(rows)
        except (EngineRuleError, EngineDeadError):
            raise
        except Exception as err:  # noqa: BLE001  (the model failed on someone's tokens: find whose)
            return self.recover(rows, err)

    def _run(self, rows: list[ScheduledRow]) -> RunnerOutput:
        step = self.prepare(rows)
        self.forward(step)
        return self.finish(step)

    # -- the three parts of a step, apart for async scheduling ---------------------------------------
    def prepare(self, rows: list[ScheduledRow]) -> dict:
        """Pack the rows and build the step's metadata (host work, and the step's one copy to the device)."""
        batch = self.input_batch
        for row in rows:
            batch.redo_from(row)  # a cached prefix whose K/V were never written is computed again
        chunks = [batch.chunk(row) for row in rows]
        counts = [row.num_tokens for row in rows]
        meta = self.kv_cache.build_metadata([t for ch in chunks for t in ch], [r.start for r in rows], counts,
                                            self.info.device, block_tables=[r.state.block_ids for r in rows],
                                            request_ids=[r.req_id for r in rows])
        # Logits of each row's last token -- and of its last 1 + guesses tokens when it speculates.
        num_logits = [len(r.draft_ids) + 1 for r in rows]
        rows_t = self._logit_rows(meta, counts, num_logits, any(r.draft_ids for r in rows))
        kwargs = self.kv_cache.forward_kwargs(meta)
        if self.info.accepts_logits_to_keep:
            kwargs["logits_to_keep"] = rows_t
        return {"rows": rows, "chunks": chunks, "meta": meta, "kwargs": kwargs, "logit_rows": rows_t,
                "first_row": [0, *itertools.accumulate(num_logits)]}  # row i's logits: first_row[i]:[i+1]

    @torch.inference_mode()
    def forward(self, step: dict) -> None:
        """The model, once (what async scheduling runs in its worker thread); fills ``step``."""
        meta, kwargs = step["meta"], step["kwargs"]
        t0 = time.perf_counter()
        out = self.model(input_ids=meta.input_ids, position_ids=meta.positions, **kwargs)
        step["forward_time"] = time.perf_counter() - t0
        step["traffic"] = self.kv_cache.after_forward(meta)
        step["logits"] = out.logits[0] if self.info.accepts_logits_to_keep else out.logits[0, step["logit_rows"]]

    def finish(self, step: dict) -> RunnerOutput:
        """Sample from the step's logits; the sampled tokens join the persistent batch. Returns the
        :class:`RunnerOutput` the scheduler updates from."""
        rows = step["rows"]
        sampled, fork_tokens, errors = self._sample(step["logits"], rows, step["first_row"])
        for row, tokens, forks, err in zip(rows, sampled, fork_tokens, errors):
            self.input_batch.written(row, ok=err is None)
            if tokens and err is None:
                self.input_batch.append(row.req_id, tokens)
            for sample_id, token in (forks or {}).items():
                self.input_batch.append(sample_id, [token])
        return RunnerOutput(sampled=sampled, req_ids=[r.req_id for r in rows], chunks=step["chunks"],
                            forward_time=step["forward_time"], traffic=step["traffic"], fork_tokens=fork_tokens,
                            errors=errors if any(e is not None for e in errors) else None, comm=step.get("comm"))

    def recover(self, rows: list[ScheduledRow], err: Exception) -> RunnerOutput:
        """The forward pass raised: run each row alone; the ones the model fails on get an error, and
        the blocks they were to fill are unwritten -- a later row that reads them (an admission of this
        very step that found them as its cached prefix) computes them itself."""
        if len(rows) == 1:
            return self._failed(rows, err)
        parts = []
        for row in rows:
            try:
                parts.append(self._run([row]))
            except (EngineRuleError, EngineDeadError):
                raise
            except Exception as e:  # noqa: BLE001
                parts.append(self._failed([row], e))
        return RunnerOutput(
            sampled=[p.sampled[0] for p in parts], req_ids=[r.req_id for r in rows],
            chunks=[p.chunks[0] if p.chunks else [] for p in parts],
            forward_time=sum(p.forward_time for p in parts), traffic=next((p.traffic for p in parts if p.traffic), None),
            fork_tokens=[p.fork_tokens[0] if p.fork_tokens else None for p in parts],
            errors=[p.error(0) for p in parts])

    def _failed(self, rows: list[ScheduledRow], err: Exception) -> RunnerOutput:
        """Every row of ``rows`` failed with ``err``: its blocks stay unwritten."""
        for row in rows:
            self.input_batch.written(row, ok=False)
        n = len(rows)
        message = f"the model failed on this request's tokens: {type(err).__name__}: {err}"
        return RunnerOutput(sampled=[None] * n, req_ids=[r.req_id for r in rows], chunks=[[] for _ in range(n)],
                            fork_tokens=[None] * n, errors=[message] * n)

    def _logit_rows(self, meta, counts, num_logits, speculative: bool) -> torch.Tensor:
        """Packed rows whose logits we need: each sequence's last (``meta.logits_indices``), or, in a
        step with speculative guesses, the last ``1 + guesses`` rows of a speculating one (a second, small copy)."""
        if not speculative:
            return meta.logits_indices
        ends = itertools.accumulate(counts)
        return torch.tensor([i for e, k in zip(ends, num_logits) for i in range(e - k, e)], device=self.info.device)

    def _sample(self, logits, rows: list[ScheduledRow], first_row: list[int]) -> tuple[list, list, list]:
        """One new token per row whose known tokens are now all computed (``None`` for a prefill chunk
        that stopped short); a speculating row keeps the guesses the model agrees with. A prompt with
        parallel samples forking from it gives each its own first token, drawn from the same logits
        with the sample's own generator (the prompt is computed once). A row that cannot be sampled
        gets an error instead."""
        sampled: list = [None] * len(rows)
        fork_tokens: list = [None] * len(rows)
        errors: list = [None] * len(rows)
        plain = [i for i, r in enumerate(rows) if not r.draft_ids and r.end >= len(r.state.token_ids)]
        if plain:
            batch = self.input_batch
            # Forks: one row each, the same logits; each sample's state (its generator) starts here.
            picks = [(i, None, rows[i].state) for i in plain] + \
                [(i, fid, batch.fork(rows[i].state, fid, index)) for i in plain for fid, index in rows[i].forks]
            picked, row_errors = sample_rows(logits[[first_row[i + 1] - 1 for i, _, _ in picks]],
                                             [s.sampling_params for _, _, s in picks], [s.generator for _, _, s in picks])
            for (i, fid, _), token, err in zip(picks, picked, row_errors):
                if err is not None:
                    errors[i] = errors[i] or err  # a fork's failure fails the prompt it shares
                elif fid is None:
                    sampled[i] = [token]
                else:
                    fork_tokens[i] = {**(fork_tokens[i] or {}), fid: token}
        for i, r in enumerate(rows):
            if r.draft_ids:  # greedy verification of the guesses (drafts are only made for greedy requests)
                block = logits[first_row[i]:first_row[i + 1]]
                if not bool(torch.isfinite(block).all()):
                    errors[i] = "the model produced logits that are not finite for this request"
                    continue
                sampled[i] = accept(r.draft_ids, block.argmax(dim=-1).tolist())
        return sampled, fork_tokens, errors
