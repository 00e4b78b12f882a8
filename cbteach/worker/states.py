"""The message changes the worker's batch: vLLM V1's ``_update_states``, in the order V1 does it.

The worker never reads the scheduler's objects. Each step's
:class:`~cbteach.core.scheduler_output.SchedulerOutput` is the only news it gets, and
:func:`update_batch` turns it into the worker's state -- ``runner.requests`` (a
:class:`~cbteach.worker.input_batch.CachedRequestState` per request it holds) and
``runner.input_batch`` (a row per request scheduled now). Read beside V1's
``GPUModelRunner._update_states`` (``vllm/v1/worker/gpu_model_runner.py``):

1. **forget who finished** -- their states and their rows;
2. **rows of requests not scheduled now leave the batch** -- preempted ones, or running ones the
   token budget left out this step; their states stay, they will be back;
3. **new requests** get a state: prompt, sampling parameters, a generator (seeded ones), block ids,
   where they start (past a prefix-cache hit);
4. **cached requests** get where they start now and their new blocks, appended -- or, resumed after a
   preemption (or, cbteach's, a table changed other than by appending), their whole table;
   a request resumed that missed the step before also gets its token ids. Those with a row are
   changed in place; the others are added;
5. **add, then condense**: new and returning requests take the lowest free rows, the last rows move
   into the holes left, and rows ``0 .. num_reqs - 1`` are this step's batch, in packed order.

Notebook 06b asks you to write :func:`update_batch` yourself and runs the engine on yours
(``Engine(..., update_batch=...)``).
"""
from __future__ import annotations

import torch

from ..core.sampling import make_generator
from .input_batch import CachedRequestState

__all__ = ["update_batch", "new_generator"]


def update_batch(runner, msg) -> None:
    """Change ``runner.requests`` and ``runner.input_batch`` as ``msg`` says (see the module)."""
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
