"""The model runner's persistent batch: its own state of every request it runs, changed only by messages.

The scheduler and the runner share no objects (:mod:`cbteach.core.scheduler_output`). What the runner
needs to run a request -- its token ids, its block table, where it starts, its random stream --
it keeps here, in a :class:`CachedRequestState` per request, and updates from each step's
:class:`~cbteach.core.scheduler_output.SchedulerOutput` (:meth:`InputBatch.update`) and from the tokens
it samples itself (:meth:`InputBatch.append`). This is vLLM V1's ``CachedRequestState`` and the
``_update_states`` of its GPU model runner (``vllm/v1/worker/gpu_input_batch.py``,
``vllm/v1/worker/gpu_model_runner.py``), in miniature: V1 also keeps the batch's rows in
preallocated arrays (token ids, block table) so a step copies little to the device; here each step
builds its arrays from these states (:mod:`cbteach.attention.metadata`).

Why the runner appends the tokens it sampled instead of being told them: with async scheduling the
next step is planned before this step's tokens exist, and it runs right after -- the runner is the
only one that knows them in time (V1 keeps them on the device, ``prev_sampled_token_ids``).

The runner also remembers **blocks whose K/V were never written**: blocks a step was to fill for a
request the model failed on. Another request may read them as a cached prefix -- planned (perhaps a
step ahead, with async scheduling) before the failure was known. Such a request computes them
again itself, from the first unwritten block on: the same tokens at the same positions give the same
K/V, so its answer stays exact (:meth:`InputBatch.redo_from`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.sampling import SamplingParams, make_generator
from ..core.scheduler_output import SchedulerOutput


@dataclass
class CachedRequestState:
    """What the runner knows of one request (V1's ``CachedRequestState``)."""

    req_id: object
    token_ids: list[int]  # prompt + output, as far as the runner has them
    sampling_params: SamplingParams
    generator: object  # its torch.Generator (seeded sampling), or None: the global random stream
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # where its next chunk starts (from the message)


@dataclass
class ScheduledRow:
    """One request's part in one step, as the runner runs it."""

    state: CachedRequestState
    start: int  # position of its first fed token
    num_tokens: int  # tokens fed (known ones, then guesses)
    draft_ids: list[int]  # speculative guesses fed after the known tokens
    forks: list = field(default_factory=list)  # (sample id, sample index) forking from it when its prompt is done

    @property
    def req_id(self):
        return self.state.req_id

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


class InputBatch:
    """Every request the runner holds, by id; see the module."""

    def __init__(self, block_size: int | None = None):
        self.block_size = block_size  # None: the concatenating cache (no blocks)
        self.requests: dict[object, CachedRequestState] = {}
        self.unwritten_blocks: set[int] = set()

    def update(self, msg: SchedulerOutput) -> list[ScheduledRow]:
        """Apply one step's message -- forget finished requests, add new ones, apply the cached ones'
        changes -- and return the step's rows, in packed order."""
        for rid in msg.finished_req_ids:
            self.requests.pop(rid, None)
        for new in msg.scheduled_new_reqs:
            old = self.requests.get(new.req_id)  # a forked sample: its generator already drew its first token
            generator = old.generator if old is not None else _generator(new)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id, token_ids=[*new.prompt_token_ids, *new.output_token_ids],
                sampling_params=new.sampling_params, generator=generator, block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens)
        c = msg.scheduled_cached_reqs
        for rid, replace, blocks, computed in zip(c.req_ids, c.replace_block_ids, c.new_block_ids,
                                                  c.num_computed_tokens):
            state = self.requests[rid]
            if replace:
                state.block_ids = list(blocks)
            else:
                state.block_ids.extend(blocks)
            state.num_computed_tokens = computed
        for src, dst in msg.block_copies:  # a copy on write takes over what its source holds, written or not
            if src in self.unwritten_blocks:
                self.unwritten_blocks.add(dst)
        rows = []
        for rid, n in msg.num_scheduled_tokens.items():
            state = self.requests[rid]
            rows.append(ScheduledRow(state=state, start=state.num_computed_tokens, num_tokens=n,
                                     draft_ids=list(msg.scheduled_spec_decode_tokens.get(rid, ())),
                                     forks=list(msg.scheduled_forks.get(rid, ()))))
        return rows

    def chunk(self, row: ScheduledRow) -> list[int]:
        """The token ids ``row`` feeds: its known tokens from ``start``, then its guesses. A token the
        step before was to sample for it but did not (that request failed; async scheduling planned
        past it) is fed as id 0: its output is dropped."""
        end = row.end - len(row.draft_ids)
        known = row.state.token_ids[row.start:end]
        return known + [0] * (end - row.start - len(known)) + row.draft_ids

    def append(self, req_id, tokens: list[int]) -> None:
        """The tokens the runner sampled for ``req_id`` are its next ones."""
        state = self.requests.get(req_id)
        if state is not None:
            state.token_ids.extend(tokens)

    def fork(self, parent: CachedRequestState, sample_id, sample_index: int) -> CachedRequestState:
        """A sample forking from ``parent``'s prompt: its own random stream (``seed + sample_index``);
        its blocks and tokens come with its first message."""
        state = CachedRequestState(req_id=sample_id, token_ids=list(parent.token_ids),
                                   sampling_params=parent.sampling_params,
                                   generator=make_generator(parent.sampling_params, sample_index))
        self.requests[sample_id] = state
        return state

    # -- blocks whose K/V were never written ---------------------------------------------------------
    def blocks_of(self, state: CachedRequestState, start: int, end: int) -> list[int]:
        """The blocks holding positions ``start .. end - 1`` of ``state`` (none for the concat cache)."""
        if self.block_size is None or end <= start:
            return []
        return state.block_ids[start // self.block_size:(end - 1) // self.block_size + 1]

    def redo_from(self, row: ScheduledRow) -> None:
        """If ``row`` would read a block whose K/V were never written, start it at that block instead."""
        if not self.unwritten_blocks:
            return
        reads = self.blocks_of(row.state, 0, row.start)
        first = next((k for k, b in enumerate(reads) if b in self.unwritten_blocks), None)
        if first is not None:
            new_start = first * self.block_size
            row.num_tokens += row.start - new_start
            row.start = new_start

    def written(self, row: ScheduledRow, ok: bool) -> None:
        """After ``row`` ran: its blocks hold its K/V (``ok``), or never will (the model failed on it)."""
        blocks = self.blocks_of(row.state, row.start, row.end)
        if ok:
            self.unwritten_blocks.difference_update(blocks)
        else:
            self.unwritten_blocks.update(blocks)

    def generator_state(self, req_id) -> bytes | None:
        """``req_id``'s random stream as bytes (to hand a seeded request over to another engine)."""
        state = self.requests.get(req_id)
        if state is None or state.generator is None:
            return None
        return bytes(state.generator.get_state().tolist())


def _generator(new):
    generator = make_generator(new.sampling_params, new.sample_index)
    if generator is not None and new.generator_state is not None:
        generator.set_state(torch.tensor(list(new.generator_state), dtype=torch.uint8))
    return generator
