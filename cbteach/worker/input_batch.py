"""The worker's persistent batch: a row per request, in preallocated arrays, changed only by messages.

The scheduler and the worker share no objects (:mod:`cbteach.core.scheduler_output`). What the worker
needs to run a request it keeps twice, as vLLM V1's GPU model runner does:

* a :class:`CachedRequestState` per request it has been told about (``ModelRunner.requests``) --
  prompt, output so far, sampling parameters, random stream, block ids -- for as long as the request
  lives, also while it is preempted or not scheduled this step;
* a **row** of the :class:`InputBatch` per request scheduled this step: ``token_ids[row]`` (prompt, then
  output), ``num_tokens``, ``num_computed_tokens``, the block table (:class:`BlockTable`: a row of one 2-D
  tensor) and the sampling parameters. A step's inputs are read from these arrays -- the block tables are
  ``table[:num_reqs]``, a slice; the token ids one gather -- not rebuilt from lists.

The message is a *diff* because the rows persist: a request that keeps running keeps its row, and the
message says only what changed -- its new blocks, where it starts. ``add_request``, ``remove_request``
and ``condense`` are the three ways rows change (V1's ``InputBatch``, ``vllm/v1/worker/gpu_input_batch.py``,
has these and more: ``swap_states``, ``refresh_metadata``). A removed request leaves a hole, an added one
takes the lowest hole, and ``condense`` moves the last rows into the holes left, so rows
``0 .. num_reqs - 1`` are the batch, in packed order.

What is cbteach's: the arrays are CPU tensors read through numpy views (V1 keeps numpy views too, and GPU
twins it copies slices into; here the step's metadata goes to the device in one copy anyway); they start
small and double when a request needs more columns or the batch more rows (V1 allocates ``max_model_len``
columns at start); the sampling parameters are kept per row as :class:`SamplingParams` (V1 keeps
temperature, top-p and top-k arrays for a batched sampler).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..core.sampling import SamplingParams


@dataclass
class CachedRequestState:
    """What the worker knows of one request, whether or not it is in this step's batch (V1's
    ``CachedRequestState``)."""

    req_id: object
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    generator: object  # its torch.Generator (a seeded request), or None: the runner's shared stream
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # where its next chunk starts (from the message)
    output_token_ids: list[int] = field(default_factory=list)  # what it sampled so far

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


class InputBatch:
    """The requests of the current step, one per row (see the module). ``req_ids[row]`` is the
    request in ``row``; ``req_id_to_index`` the other way round."""

    def __init__(self, max_num_reqs: int, max_model_len: int | None = None, width: int = 256):
        rows = max(1, max_num_reqs)
        self.max_model_len = max_model_len
        self.req_ids: list = []  # row -> request id (None: a hole until condense)
        self.req_id_to_index: dict = {}
        self._holes: list[int] = []  # rows emptied since the last condense, lowest first
        self.token_ids = torch.zeros((rows, min(width, max_model_len or width)), dtype=torch.long)
        self.token_ids_np = self.token_ids.numpy()  # the same memory
        self.num_tokens = np.zeros(rows, dtype=np.int64)  # known tokens (prompt + output)
        self.num_prompt_tokens = np.zeros(rows, dtype=np.int64)
        self.num_computed_tokens = np.zeros(rows, dtype=np.int64)
        self.block_table = BlockTable(rows)
        self.sampling_params: list[SamplingParams | None] = [None] * rows
        self.generators: dict[int, object] = {}  # row -> its generator (seeded requests only, as V1)
        self.random_reqs: set = set()  # requests that do not decode greedily (V1's random_reqs)

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    @property
    def all_greedy(self) -> bool:
        return not self.random_reqs

    # -- the three ways rows change -------------------------------------------------------------------
    def add_request(self, state: CachedRequestState) -> int:
        """Give ``state``'s request a row -- the lowest hole, else the next row -- and copy its tokens,
        blocks and sampling parameters into it. Returns the row."""
        row = self._holes.pop(0) if self._holes else len(self.req_ids)
        if row == len(self.req_ids):
            self.req_ids.append(None)
            self._grow_rows(row + 1)
        self.req_ids[row] = state.req_id
        self.req_id_to_index[state.req_id] = row
        n_prompt, n = len(state.prompt_token_ids), state.num_tokens
        self._fit_width(n)
        self.token_ids_np[row, :n_prompt] = state.prompt_token_ids
        self.token_ids_np[row, n_prompt:n] = state.output_token_ids
        self.num_prompt_tokens[row], self.num_tokens[row] = n_prompt, n
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.block_table.add_row(state.block_ids, row)
        self.sampling_params[row] = state.sampling_params
        if state.generator is not None:
            self.generators[row] = state.generator
        if not state.sampling_params.greedy:
            self.random_reqs.add(state.req_id)
        return row

    def remove_request(self, req_id) -> int | None:
        """Empty ``req_id``'s row (always followed by :meth:`condense`); returns it, or ``None`` if the
        request had no row."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self.req_ids[row] = None
        self.sampling_params[row] = None
        self.generators.pop(row, None)
        self.random_reqs.discard(req_id)
        self._holes.append(row)
        self._holes.sort()
        return row

    def condense(self) -> None:
        """Move the last rows down into the holes, so the batch is rows ``0 .. num_reqs - 1``."""
        last = len(self.req_ids) - 1
        while self._holes:
            while last >= 0 and self.req_ids[last] is None:
                last -= 1
            hole = self._holes[0]
            if hole >= last:
                break
            self._holes.pop(0)
            self._move(last, hole)
            last -= 1
        self._holes.clear()
        del self.req_ids[self.num_reqs:]

    # -- tokens ---------------------------------------------------------------------------------------
    def append_token_ids(self, row: int, tokens: list[int]) -> None:
        """Tokens sampled for ``row``'s request join its known tokens."""
        n = int(self.num_tokens[row])
        self._fit_width(n + len(tokens))
        self.token_ids_np[row, n:n + len(tokens)] = tokens
        self.num_tokens[row] = n + len(tokens)

    def append_one_each(self, rows: list[int], tokens: list[int]) -> None:
        """One token each for ``rows`` (a step's decodes), in one write."""
        rows = np.asarray(rows)
        ends = self.num_tokens[rows]
        self._fit_width(int(ends.max()) + 1)
        self.token_ids_np[rows, ends] = tokens
        self.num_tokens[rows] = ends + 1

    def token_row(self, row: int) -> list[int]:
        """``row``'s known tokens, as a list (for reading; steps gather from the tensor)."""
        return self.token_ids_np[row, :self.num_tokens[row]].tolist()

    # -- internals ---------------------------------------------------------------------------------
    def _move(self, src: int, dst: int) -> None:
        rid = self.req_ids[src]
        self.req_ids[dst], self.req_ids[src] = rid, None
        self.req_id_to_index[rid] = dst
        n = int(self.num_tokens[src])
        self.token_ids_np[dst, :n] = self.token_ids_np[src, :n]
        for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens):
            arr[dst] = arr[src]
        self.block_table.move_row(src, dst)
        self.sampling_params[dst], self.sampling_params[src] = self.sampling_params[src], None
        generator = self.generators.pop(src, None)
        if generator is not None:
            self.generators[dst] = generator

    def _grow_rows(self, rows: int) -> None:
        """More rows than allocated (a batch larger than ``max_num_reqs``): double them."""
        have = self.token_ids.shape[0]
        if rows <= have:
            return
        new = max(rows, 2 * have)
        self._resize(new, self.token_ids.shape[1])
        for name in ("num_tokens", "num_prompt_tokens", "num_computed_tokens"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(new - have, dtype=np.int64)]))
        self.sampling_params += [None] * (new - have)
        self.block_table.grow_rows(new)

    def _fit_width(self, n: int) -> None:
        """Columns for ``n`` tokens, doubling what is short."""
        have = self.token_ids.shape[1]
        if n > have:
            self._resize(self.token_ids.shape[0], max(n, 2 * have))

    def _resize(self, rows: int, cols: int) -> None:
        old = self.token_ids
        self.token_ids = torch.zeros((rows, cols), dtype=torch.long)
        self.token_ids[:old.shape[0], :old.shape[1]] = old
        self.token_ids_np = self.token_ids.numpy()


class BlockTable:
    """``table[row, :num_blocks[row]]`` is the block table of the request in ``row`` (V1's ``BlockTable``,
    ``vllm/v1/worker/block_table.py``, without its CPU/GPU pair of buffers). The KV manager decides which
    blocks a request owns; the worker keeps a copy, changed in place by the message. Entries past a row's
    ``num_blocks`` are stale ids nobody reads: attention masks every key past a sequence's length."""

    def __init__(self, max_num_reqs: int, max_num_blocks: int = 16):
        self.table = torch.zeros((max_num_reqs, max(1, max_num_blocks)), dtype=torch.long)
        self.np = self.table.numpy()  # the same memory: numpy's element access is far cheaper than torch's
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)

    def add_row(self, block_ids: list[int], row: int) -> None:
        """``row`` holds a new request: its whole table."""
        self.num_blocks[row] = 0
        self.append_row(block_ids, row)

    def append_row(self, block_ids: list[int], row: int) -> None:
        """Blocks allocated to ``row``'s request since the last step go after its others."""
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        self._fit(self.table.shape[0], end)
        self.np[row, start:end] = block_ids
        self.num_blocks[row] = end

    def move_row(self, src: int, dst: int) -> None:
        """The request in ``src`` now lives in ``dst`` (the batch condensed)."""
        n = int(self.num_blocks[src])
        self.np[dst, :n] = self.np[src, :n]
        self.num_blocks[dst] = n

    def row(self, row: int) -> list[int]:
        """``row``'s block table, as a list (for reading; the step uses the tensor)."""
        return self.np[row, :self.num_blocks[row]].tolist()

    def grow_rows(self, num_rows: int) -> None:
        """Room for ``num_rows`` requests."""
        self._fit(num_rows, self.table.shape[1])

    def _fit(self, rows: int, cols: int) -> None:
        """Make the tensor at least ``rows x cols``, doubling what is short (the contents are kept)."""
        old_rows, old_cols = self.table.shape
        if rows <= old_rows and cols <= old_cols:
            return
        new_rows = max(old_rows, rows if rows <= old_rows else max(rows, 2 * old_rows))
        new_cols = max(old_cols, cols if cols <= old_cols else max(cols, 2 * old_cols))
        table = torch.zeros((new_rows, new_cols), dtype=torch.long)
        table[:old_rows, :old_cols] = self.table
        self.table, self.np = table, table.numpy()
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros(new_rows - old_rows, dtype=np.int64)])
