"""The model runner: the message changes the persistent batch; then the step is packed, run once, sampled.

The scheduler decides *who* runs and *how many* tokens each feeds, and sends it as a message
(:class:`~cbteach.core.scheduler_output.SchedulerOutput`: plain data). The runner owns everything on the
worker's side -- the requests' states, the :class:`~cbteach.worker.input_batch.InputBatch` (a row per
scheduled request), the KV pool -- and runs a step in four calls, as vLLM V1's GPU model runner splits it
(``vllm/v1/worker/gpu_model_runner.py``: ``_update_states``, ``_prepare_inputs``, the model, ``sample_tokens``):

1. :meth:`ModelRunner.update_states` -- :func:`update_batch`: the message changes the batch;
2. :meth:`ModelRunner.prepare_inputs` -- the step's inputs, read from the rows: token ids in one gather,
   the block tables a slice; the KV cache builds the attention metadata (positions, slot mapping);
3. :meth:`ModelRunner.forward` -- the model, once, on the packed row; :meth:`ModelRunner.sample` -- a token
   for each row that reached the end of its known tokens, on the device (:func:`sample_on_device`);
4. :meth:`ModelRunner.finish` -- the tokens come to the host, join the rows and the states, and go back to
   the scheduler as a :class:`~cbteach.core.scheduler_output.RunnerOutput`, in the batch's row order.

The worker samples (V1's workers each run the sampler), so no token is sent anywhere: the batch appends
its own. When the forward pass raises, cbteach's rule, not V1's: one request's failure is its own
(:mod:`cbteach.worker.recovery`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..core.sampling import make_generator, sample
from ..core.scheduler_output import RunnerOutput
from ..errors import EngineDeadError, EngineRuleError
from .input_batch import CachedRequestState, InputBatch
from .step import NOT_FINITE, Step
from . import recovery


# -- 1. the message changes the batch ------------------------------------------------------------------
def update_batch(runner, msg) -> None:
    """Change ``runner.requests`` (a :class:`CachedRequestState` per request it holds) and
    ``runner.input_batch`` (a row per request scheduled now) as ``msg`` says, in the order of V1's
    ``GPUModelRunner._update_states``:

    1. **forget who finished** -- their states and their rows;
    2. **rows of requests not scheduled now leave the batch** (preempted, or left out by the token
       budget); their states stay, they will be back;
    3. **new requests** get a state: prompt, sampling parameters, a generator, block ids, where they start;
    4. **cached requests** get where they start now and their new blocks, appended -- or their whole table,
       if resumed after a preemption (or, cbteach's, a table changed other than by appending); a resumed
       request that missed the step before also gets its token ids. Those with a row change in place;
    5. **add, then condense**: new and returning requests take the lowest free rows, the last rows move
       into the holes, and rows ``0 .. num_reqs - 1`` are this step's batch, in packed order.

    Notebook 06b asks you to write it yourself and runs the engine on yours (``Engine(..., update_batch=...)``).
    """
    batch = runner.input_batch
    for rid in msg.finished_req_ids:  # 1.
        runner.requests.pop(rid, None)
        batch.remove_request(rid)
    for rid in [r for r in batch.req_id_to_index if r not in msg.num_scheduled_tokens]:  # 2.
        batch.remove_request(rid)
    to_add = []
    for new in msg.scheduled_new_reqs:  # 3.
        old = runner.requests.get(new.req_id)  # a forked sample: its generator drew its first token already
        state = CachedRequestState(
            req_id=new.req_id, prompt_token_ids=list(new.prompt_token_ids), sampling_params=new.sampling_params,
            generator=old.generator if old is not None else new_generator(new), block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens, output_token_ids=list(new.output_token_ids))
        runner.requests[new.req_id] = state
        to_add.append(state)
    cached = msg.scheduled_cached_reqs  # 4.
    for i, rid in enumerate(cached.req_ids):
        state = runner.requests[rid]
        state.num_computed_tokens = cached.num_computed_tokens[i]
        resumed = rid in cached.resumed_req_ids
        whole = resumed or rid in cached.replaced_req_ids
        if rid in cached.all_token_ids:
            state.output_token_ids = list(cached.all_token_ids[rid][len(state.prompt_token_ids):])
        new_blocks = cached.new_block_ids[i]
        if whole:
            state.block_ids = list(new_blocks)
        else:
            state.block_ids.extend(new_blocks)
        row = batch.req_id_to_index.get(rid)
        if row is not None and resumed:  # (V1 too takes a resumed request out of its batch and adds it afresh:
            # its reset_prefix_cache's forced preemption can leave one there)
            batch.remove_request(rid)
            row = None
        if row is None:
            to_add.append(state)
            continue
        batch.num_computed_tokens[row] = state.num_computed_tokens
        if whole:
            batch.block_table.add_row(state.block_ids, row)
        else:
            batch.block_table.append_row(new_blocks, row)
    for state in to_add:  # 5.
        batch.add_request(state)
    batch.condense()


def new_generator(new):
    """The random stream of a request seen for the first time: ``seed + sample_index`` (``None``: an
    unseeded request draws from the global stream), or a handed-over request's stream, going on."""
    generator = make_generator(new.sampling_params, new.sample_index)
    if generator is not None and new.generator_state is not None:
        generator.set_state(torch.tensor(list(new.generator_state), dtype=torch.uint8))
    return generator


class ModelRunner:
    """Runs each step's message on ``model`` (the engine's own view of the user's model,
    :func:`~cbteach.core.model_view.model_view`) over ``kv_cache``'s pool."""

    step_cls = Step  # what prepare_inputs builds
    default_update_batch = staticmethod(update_batch)  # V1's order (above)

    def __init__(self, model, kv_cache, *, device, accepts_logits_to_keep: bool, max_num_reqs: int,
                 max_model_len: int | None = None, update_batch=None):
        self.model, self.kv_cache, self.device = model, kv_cache, torch.device(device)
        self.accepts_logits_to_keep = accepts_logits_to_keep
        self.block_size = kv_cache.block_size if kv_cache.kind == "paged" else None
        self.requests: dict[object, CachedRequestState] = {}  # every request it was told of and not yet finished
        self.input_batch = InputBatch(max_num_reqs, max_model_len)
        self.unwritten_blocks: set[int] = set()
        self.update_batch = update_batch or self.default_update_batch  # notebook 06b's, if given

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
        """The message changes the batch (V1's ``_update_states``): :func:`update_batch`, or the one given."""
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
        if self.unwritten_blocks:  # a cached prefix whose K/V a failed step never wrote is computed again
            recovery.redo_rows(self, req_ids, starts, counts)
        samples = (np.add(starts, counts) >= b.num_tokens[:B]).tolist()
        # Token ids: one gather from the rows -- row i's tokens starts[i] .. starts[i] + counts[i] - 1.
        T = sum(counts)
        first = np.arange(B) * b.token_ids.shape[1] + starts
        idx = first if T == B else np.repeat(first - np.cumsum([0, *counts[:-1]]), counts) + np.arange(T)
        step = self.step_cls(msg, list(range(B)), req_ids, starts, counts, samples,
                             input_ids=b.token_ids_np.reshape(-1)[idx])
        self.build_inputs(step, b.block_table.np[:B], b.block_table.num_blocks[:B])
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
        if self.unwritten_blocks or step.meta.non_finite_rows or any(e is not None for e in errors):  # (see recovery)
            sampled, errors = recovery.note_rows(self, step, sampled, errors)
        self._append_all(step.req_ids, sampled)
        return RunnerOutput(sampled=sampled, req_ids=list(step.req_ids), forward_time=step.forward_time,
                            traffic=step.traffic, errors=errors if any(e is not None for e in errors) else None)

    def sampled_tokens(self, step: Step) -> tuple[list, list]:
        """Each row's new tokens (``None``: it samples nothing, or failed) and error, on the host: the step's one
        device -> host copy. A chunk that samples nothing fails too if its last logits are not finite (NaN K/V)."""
        tokens, finite = step.sampled.to_host()
        errors = [None] * len(tokens)
        if step.sampled.errors or not all(finite):
            errors = [(step.sampled.errors.get(i) if s else None) or (None if f else NOT_FINITE)
                      for i, (s, f) in enumerate(zip(step.samples, finite))]
        return [[t] if s and e is None else None for t, s, e in zip(tokens, step.samples, errors)], errors

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


# -- 3. sampling: tokens on the device, then on the host ------------------------------------------
@dataclass
class DeviceSample:
    """A step's sampled tokens, still on the device. ``tokens[i]``: what row ``i`` feeds next (where it
    samples nothing or failed, that output is dropped on the host); ``top[i]``: the largest of its logits
    -- not finite when its logits were not."""

    tokens: torch.Tensor
    top: torch.Tensor
    errors: dict = field(default_factory=dict)  # row -> what went wrong when drawing its token

    @property
    def finite(self) -> torch.Tensor:
        """Per row: its logits were finite (their largest is: a NaN or an infinity would be)."""
        return torch.isfinite(self.top)

    def to_host(self) -> tuple[list, list]:
        """The device -> host copy: tokens and finite flags, as lists."""
        return self.tokens.tolist(), [math.isfinite(x) for x in self.top.tolist()]


def sample_on_device(logits: torch.Tensor, params: list, generators: list) -> DeviceSample:
    """Sample each row of ``logits`` ``[rows, vocab]``: ``params[i]`` and ``generators[i]`` are row
    ``i``'s sampling parameters and generator (``None``: greedy; the global stream). A greedy batch
    never leaves the device here."""
    top, tokens = logits.max(dim=-1)  # (the first maximum, as argmax and generate take it)
    out = DeviceSample(tokens=tokens, top=top)
    random_rows = [i for i, p in enumerate(params) if p is not None and not p.greedy]
    if random_rows:
        ok = out.finite.tolist()  # a draw from non-finite logits would fail anyway
        for i in random_rows:
            if ok[i]:
                try:
                    tokens[i] = sample(logits[i:i + 1], [params[i]], [generators[i]])[0]
                except (RuntimeError, ValueError) as err:
                    out.errors[i] = f"sampling failed: {err}"
    return out
