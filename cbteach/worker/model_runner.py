"""The model runner: apply the message to the persistent batch, then pack, run the model once, sample.

The scheduler decides *who* runs and *how many* tokens each feeds, and sends it as a message (a
:class:`~cbteach.core.scheduler_output.SchedulerOutput`: plain data, no live request objects). The
runner owns everything the step needs on the worker's side -- the requests' states, the
:class:`~cbteach.worker.input_batch.InputBatch` (a row per scheduled request), the KV pool -- and a
step is four calls, the way vLLM V1's GPU model runner splits it (``vllm/v1/worker/gpu_model_runner.py``:
``_update_states``, ``_prepare_inputs``, the model, ``sample_tokens``):

1. :meth:`ModelRunner.update_states` -- the message changes the batch: finished requests are forgotten,
   rows of requests not scheduled now leave (their states stay), new requests get a state and a row,
   running ones get their new blocks and start, resumed ones their whole table; then ``condense``;
2. :meth:`ModelRunner.prepare_inputs` -- the step's inputs are read from the rows: token ids in one
   gather, the block tables a slice; the KV cache builds the step's metadata (positions, slot
   mapping, attention groups) and ``logits_to_keep`` asks the model for each row's last logits only;
3. :meth:`ModelRunner.forward` -- the model, once, on the packed row; then :meth:`ModelRunner.sample`
   -- each row that reached the end of its known tokens gets a token, on the device
   (:mod:`cbteach.worker.sampler`);
4. :meth:`ModelRunner.finish` -- the tokens come to the host, join the rows and the states, and go back
   to the scheduler as a :class:`~cbteach.core.outputs.RunnerOutput`, in the batch's row order.

When the forward pass raises, cbteach's rule, not V1's: one request's failure is its own
(:mod:`cbteach.worker.recovery`).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from ..core.scheduler_output import RunnerOutput
from ..errors import EngineDeadError, EngineRuleError
from .input_batch import CachedRequestState, InputBatch
from .sampler import NOT_FINITE, sample_on_device
from .step import Step
from . import recovery, states


class ModelRunner:
    """Runs each step's message on ``model`` (the engine's own view of the user's model,
    :func:`~cbteach.core.model_view.model_view`) over ``kv_cache``'s pool."""

    step_cls = Step  # what prepare_inputs builds

    def __init__(self, model, kv_cache, *, device, accepts_logits_to_keep: bool, max_num_reqs: int,
                 max_model_len: int | None = None, update_batch=None):
        self.model, self.kv_cache, self.device = model, kv_cache, torch.device(device)
        self.accepts_logits_to_keep = accepts_logits_to_keep
        self.block_size = kv_cache.block_size if kv_cache.kind == "paged" else None
        self.requests: dict[object, CachedRequestState] = {}  # every request it was told of and not yet finished
        self.input_batch = InputBatch(max_num_reqs, max_model_len)
        self.unwritten_blocks: set[int] = set()
        self.update_batch = update_batch or states.update_batch  # V1's, or one written in notebook 06b

    def close(self) -> None:
        """Nothing to release here (the engine's ``close`` lets go of the pool)."""

    def generator_state(self, req_id) -> bytes | None:
        """A seeded request's random stream, as bytes (for a request moved to another engine)."""
        state = self.requests.get(req_id)
        if state is None or state.generator is None:
            return None
        return bytes(state.generator.get_state().tolist())

    @torch.inference_mode()
    def execute_model(self, msg) -> RunnerOutput:
        """Apply ``msg`` to the batch and run it: the whole step, with each request's failure its own."""
        self.update_states(msg)
        if not msg.total_num_scheduled_tokens:
            return RunnerOutput.empty()
        step = self.prepare_inputs(msg)
        try:
            self.forward(step)
        except (EngineRuleError, EngineDeadError):
            raise
        except Exception as err:  # noqa: BLE001  (the model failed on someone's tokens: find whose)
            return recovery.recover(self, step, err)
        self.sample(step)
        return self.finish(step)

    def update_states(self, msg) -> None:
        """The message changes the batch (V1's ``_update_states``: :func:`~cbteach.worker.states.update_batch`)."""
        self.update_batch(self, msg)

    def changes_pool_first(self, msg) -> bool:
        """Whether ``msg`` writes inside the KV pool before its step (never here): a step in flight ends first."""
        return False

    # -- a step ---------------------------------------------------------------------------------------
    def prepare_again(self, msg, first: Step) -> Step:
        """``msg``'s step prepared again after the one before ``first`` failed, keeping what ``first`` made once."""
        return self.prepare_inputs(msg)

    def prepare_inputs(self, msg) -> Step:
        """The step's inputs, read from the batch's rows."""
        b = self.input_batch
        B = b.num_reqs
        req_ids = b.req_ids[:B]
        counts = [msg.num_scheduled_tokens[rid] for rid in req_ids]
        starts = b.num_computed_tokens[:B].tolist()
        if self.unwritten_blocks:  # a cached prefix whose K/V were never written is computed again
            recovery.redo_rows(self, req_ids, starts, counts)
        samples = (np.add(starts, counts) >= b.num_tokens[:B]).tolist()
        # Token ids: one gather from the rows -- row i's tokens starts[i] .. starts[i] + counts[i] - 1.
        T = sum(counts)
        first = np.arange(B) * b.token_ids.shape[1] + starts
        idx = first if T == B else np.repeat(first - np.cumsum([0, *counts[:-1]]), counts) + np.arange(T)
        step = self.step_cls(msg, list(range(B)), req_ids, starts, counts, samples,
                             input_ids=b.token_ids_np.reshape(-1)[idx])
        self.build_inputs(step, b.block_table.table[:B], b.block_table.num_blocks[:B])
        self._sampling_inputs(step)
        return step

    def build_inputs(self, step: Step, block_tables, num_blocks=None) -> None:
        """The step's attention metadata and the model's keyword arguments, from its token ids, positions
        and block tables (a table per row; ``num_blocks``: how many entries of each are blocks)."""
        meta = self.kv_cache.build_metadata(step.input_ids, step.starts, step.counts, self.device,
                                            block_tables=block_tables if self.block_size else None,
                                            num_blocks=num_blocks, request_ids=step.req_ids)
        step.meta, step.kwargs, step.keep = meta, self.kv_cache.forward_kwargs(meta), meta.logits_indices
        if self.accepts_logits_to_keep:
            step.kwargs["logits_to_keep"] = step.keep

    @torch.inference_mode()
    def forward(self, step: Step) -> None:
        """The model, once."""
        meta = step.meta
        t0 = time.perf_counter()
        out = self.model(input_ids=meta.input_ids, position_ids=meta.positions, **step.kwargs)
        step.forward_time = time.perf_counter() - t0
        step.traffic = self.kv_cache.after_forward(meta)
        step.logits = out.logits[0] if self.accepts_logits_to_keep else out.logits[0, step.keep]

    def _sampling_inputs(self, step: Step) -> None:
        """What sampling reads, taken from the rows when the step is prepared (a later message may
        change the rows before it samples): each row's parameters and generator."""
        b = self.input_batch
        if b.all_greedy:  # the course's case: one max over the vocabulary
            step.params = step.generators = [None] * len(step.rows)
            return
        step.params = [b.sampling_params[r] if s else None for r, s in zip(step.rows, step.samples)]
        step.generators = [b.generators.get(r) for r in step.rows]

    @torch.inference_mode()
    def sample(self, step: Step) -> None:
        """Tokens for the rows that sample, on the device (reading only the step: see ``_sampling_inputs``)."""
        step.sampled = sample_on_device(step.logits, step.params, step.generators)

    def finish(self, step: Step) -> RunnerOutput:
        """The sampled tokens come to the host, join the batch's rows and the requests' states, and go to
        the scheduler as a :class:`RunnerOutput`."""
        sampled, errors = self.sampled_tokens(step)
        failed = [i for i, e in enumerate(errors) if e is not None]
        if failed or self.unwritten_blocks:  # which blocks hold their K/V now (see recovery)
            recovery.note_rows(self, step, errors)
        self._append_all(step.req_ids, sampled)
        return RunnerOutput(sampled=sampled, req_ids=list(step.req_ids), forward_time=step.forward_time,
                            traffic=step.traffic, errors=errors if failed else None)

    def sampled_tokens(self, step: Step) -> tuple[list, list]:
        """Each row's new tokens (``None``: it samples nothing, or failed) and error (``None``: none), on
        the host: the step's one device -> host copy."""
        tokens, finite = step.sampled.to_host()
        errors = [None] * len(tokens)
        if step.sampled.errors or not all(finite):
            errors = [(step.sampled.errors.get(i) or (None if f else NOT_FINITE)) if s else None
                      for i, (s, f) in enumerate(zip(step.samples, finite))]
        return [[t] if s and e is None else None for t, s, e in zip(tokens, step.samples, errors)], errors

    def row_alone(self, step: Step, i: int) -> Step:
        """Row ``i`` of a step whose forward pass raised, as a step of its own."""
        return recovery.alone(self, step, i)

    def join_outputs(self, req_ids: list, parts: list) -> RunnerOutput:
        """The rows of such a step, run alone, as one output again."""
        return recovery.join(req_ids, parts)

    # -- internals ---------------------------------------------------------------------------------
    def _append_all(self, req_ids: list, sampled: list) -> None:
        """Each request's new tokens join its state and, if it still has one, its row -- a step's single
        tokens in one write to the token array."""
        b, rows, toks = self.input_batch, [], []
        for rid, tokens in zip(req_ids, sampled):
            state = self.requests.get(rid) if tokens else None
            if state is None:  # no token; or it finished (was aborted) while its step was in flight
                continue
            state.output_token_ids.extend(tokens)
            row = b.req_id_to_index.get(rid)
            if row is None:
                continue
            if len(tokens) == 1:
                rows.append(row)
                toks.append(tokens[0])
            else:
                b.append_token_ids(row, tokens)
        if rows:
            b.append_one_each(rows, toks)
