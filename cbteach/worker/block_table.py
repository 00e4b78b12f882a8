"""The worker's block tables: one row of block ids per request of the persistent batch, in one tensor.

The scheduler's KV manager decides which pool blocks hold each request's K/V; the worker only keeps
a copy of each running request's **block table** where a step can use it as it is -- a row of one
preallocated 2-D tensor, so the step's block tables are ``table[:num_reqs]``, a slice, not a tensor
rebuilt from lists. The message changes it in place: a new request's row is written
(:meth:`BlockTable.add_row`), a running one gets the blocks allocated since the last step appended
(:meth:`BlockTable.append_row`), and when a request leaves, the last row moves into its place
(:meth:`BlockTable.move_row`, called by the batch's ``condense``). This is vLLM V1's ``BlockTable``
(``vllm/v1/worker/block_table.py``), without its CPU/GPU pair of buffers: the step's metadata goes to
the device in one copy anyway (:func:`cbteach.attention.metadata.build`).

Entries of a row past its ``num_blocks`` are left as they were -- stale ids of an earlier request --
because nobody reads them: attention masks every key past a sequence's length.

V1 sizes the table for the longest context at start; here the columns grow by doubling when a
request needs more (a 128k-context model on a laptop does not pay for 128k columns up front).
"""
from __future__ import annotations

import numpy as np
import torch


class BlockTable:
    """``table[row, :num_blocks[row]]`` is the block table of the request in ``row``."""

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
