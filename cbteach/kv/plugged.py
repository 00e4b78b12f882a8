"""A KV manager of your own in the real engine: the two calls you write, the rest answered for you.

Notebook 05 asks for the heart of a KV manager -- a free list (``free_blocks``) and two calls,
``allocate_slots(seq, num_new_tokens)`` (return the blocks added, or ``None`` with nothing changed)
and ``free(seq)``. The scheduler asks a manager more than that (how much room there is, who holds
which block, prefix-cache lookups: :class:`cbteach.kv.interface.KVManager`), so
:class:`PluggedKVManager` stands around yours: it passes those two calls on, answers the questions
from your free list and the block tables you built, and **checks every call** against the rules a
manager must keep -- refuse without changing anything, hand out only free blocks, add exactly the
blocks the tokens need, take everything back on ``free``, lose and invent no block. A broken rule
stops the engine with :class:`~cbteach.errors.EngineRuleError` naming it, before any token can be
wrong. ``Engine(..., kv="paged", kv_manager=MyKVManager)`` builds one for you.

(No prefix caching and no copy on write on it -- ``parallel_sampling="fork"`` is refused, fanout
works; rejected speculative guesses' blocks are put back on the free list for you.)
"""
from __future__ import annotations

import math
import numbers

from ..errors import EngineRuleError
from .manager import KVCacheManager


class _FreeCount:
    """What the engine asks its allocator -- how many blocks are free, who holds each -- answered from
    the learner's free list and the block tables of the sequences it served."""

    def __init__(self, plugged):
        self.plugged = plugged

    @property
    def num_free(self) -> int:
        return len(self.plugged.mine.free_blocks)

    @property
    def ref_counts(self) -> list[int]:
        counts = [0] * self.plugged.num_blocks
        for seq in self.plugged.seqs.values():
            for block in seq.block_table:
                if _is_block(block, len(counts)):
                    counts[block] += 1
        return counts


def _is_block(b, num_blocks: int) -> bool:
    return isinstance(b, numbers.Integral) and not isinstance(b, bool) and 0 <= b < num_blocks


def _blocks(n: int) -> str:
    return f"{n} block" + ("" if n == 1 else "s")


class PluggedKVManager(KVCacheManager):
    """``mine`` -- an object with ``free_blocks``, ``allocate_slots`` and ``free`` -- as the engine's KV manager.

    ``Error`` is what a broken rule raises; notebook 05's check (:mod:`cbteach.exercises.ex05`) uses
    this same class with its own error and turns an exception from the learner's code into a hint
    (:meth:`call_mine`)."""

    copy_on_write = False  # parallel_sampling="fork" is refused on it (fanout works)
    Error: type[Exception] = EngineRuleError

    def __init__(self, mine, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        for name in ("allocate_slots", "free"):
            if not callable(getattr(mine, name, None)):
                raise ValueError(f"a KV manager needs a method {name}(seq, ...); {type(mine).__name__} has none")
        free = getattr(mine, "free_blocks", None)
        if free is None or isinstance(free, (str, bytes)) or not hasattr(free, "__len__"):
            raise ValueError(f"{type(mine).__name__} needs free_blocks: the ids of its free blocks")
        self.mine = mine
        self.allocator = _FreeCount(self)
        self._check_pool(f"{type(mine).__name__}({num_blocks}, {block_size})")

    def call_mine(self, call: str, method: str, *args):
        """``mine.<method>(*args)``. Here an exception in it propagates as it is; ``call`` describes the
        call, for a subclass that turns the exception into a message of its own."""
        return getattr(self.mine, method)(*args)

    def allocate_slots(self, seq, num_new_tokens: int, new_computed_blocks=(), num_lookahead_tokens: int = 0):
        if new_computed_blocks or num_lookahead_tokens:
            raise self.Error("a plugged-in KV manager has no prefix cache and no whole-prompt reservation")
        before, free_before, computed = list(seq.block_table), list(self.mine.free_blocks), seq.num_computed_tokens
        call = f"allocate_slots({seq.request_id}, {num_new_tokens}) with {computed} tokens computed"
        new = self.call_mine(call, "allocate_slots", seq, num_new_tokens)
        if seq.num_computed_tokens != computed:
            raise self.Error(f"{call} changed seq.num_computed_tokens to {seq.num_computed_tokens}: the KV manager "
                             "only reads it (the scheduler moves it on, when the step is planned)")
        need = math.ceil((computed + num_new_tokens) / self.block_size) - len(before)
        if new is None:
            if list(seq.block_table) != before or list(self.mine.free_blocks) != free_before:
                raise self.Error(f"{call} returned None but changed the block table or the free list: refuse "
                                 "without changing anything")
            if need <= len(free_before):
                raise self.Error(f"{call} returned None although enough blocks were free: refuse only when the "
                                 "free list is shorter than the number of *new* blocks the sequence needs")
            return None
        if new is False:  # (a refusal is None)
            raise self.Error(f"{call} returned {new!r}: to refuse, return None (and change nothing)")
        if not isinstance(new, list) or list(seq.block_table) != before + new:
            raise self.Error(f"{call}: return the list of blocks you added, and append them at the end of "
                             "seq.block_table (block i of the table holds tokens i*block_size ...)")
        held = f"{_blocks(len(seq.block_table))} ({len(seq.block_table) * self.block_size} slots)"
        if need < len(new) and len(seq.block_table) == math.ceil(seq.num_tokens / self.block_size):
            raise self.Error(f"{call} gave it {held}: room for all of its {seq.num_tokens} tokens, but this step "
                             f"computes only {num_new_tokens} of them (a prefill in chunks): make room for "
                             "num_computed_tokens + num_new_tokens")
        if need < len(new):
            raise self.Error(f"{call} gave it {held}: more than its tokens need; take a new block only when the "
                             "last one is full")
        if need > len(new) and need > len(free_before):
            raise self.Error(f"{call} gave it {held}: too few for its tokens -- it needed {need} new blocks and only "
                             f"{_blocks(len(free_before))} were free: then refuse (return None) and change nothing")
        if need > len(new):
            raise self.Error(f"{call} gave it {held}: too few for its tokens")
        for block in new:
            if block not in free_before:
                raise self.Error(f"{call} handed out block {block!r}, which was not in the free list")
            if block in self.mine.free_blocks:
                raise self.Error(f"{call} handed out block {block} but left it in the free list")
        self.seqs[seq.request_id] = seq
        self._check_pool(call)
        return new

    def free(self, seq) -> None:
        before = list(seq.block_table)
        call = f"free({seq.request_id}) with blocks {before}"
        self.call_mine(call, "free", seq)
        if not isinstance(seq.block_table, list):
            raise self.Error(f"after {call}, seq.block_table is {seq.block_table!r}: leave it an empty list, [] (a "
                             "preempted sequence comes back and appends its new blocks to it)")
        if seq.block_table:
            raise self.Error(f"after {call}, seq.block_table is not empty: a finished or preempted sequence "
                             "holds no blocks (a preempted one comes back and starts a new table)")
        missing = [b for b in before if b not in self.mine.free_blocks]
        if missing:
            raise self.Error(f"after {call}, blocks {missing} are not back in the free list")
        self.seqs.pop(seq.request_id, None)
        self._check_pool(call)

    def trim(self, seq) -> None:
        """Blocks that held only rejected speculative guesses go back to the learner's free list."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        extra, seq.block_table[keep:] = seq.block_table[keep:], []
        free = self.mine.free_blocks
        for block in extra:
            free.append(block) if hasattr(free, "append") else free.add(block)
        self._check_pool(f"trim({seq.request_id})")

    def fork(self, parent, child) -> None:
        raise self.Error("parallel_sampling='fork' needs a KV manager that copies on write")

    def _check_pool(self, call: str) -> None:
        free = list(self.mine.free_blocks)
        bad = [b for b in free if not _is_block(b, self.num_blocks)]
        if bad:
            raise self.Error(f"after {call}, the free list holds {bad[0]!r}: block ids are the ints "
                             "0 .. num_blocks - 1")
        if len(set(free)) != len(free):
            raise self.Error(f"after {call}, a block is in the free list twice")
        owners: dict = {}
        for rid, s in self.seqs.items():
            for block in s.block_table:
                if block in owners:
                    raise self.Error(f"after {call}, block {block} is in two block tables ({owners[block]} "
                                     f"and {rid})")
                owners[block] = rid
        if len(free) + len(owners) != self.num_blocks:
            raise self.Error(f"after {call}, {len(free)} free blocks + {len(owners)} in block tables != the "
                             f"pool's {self.num_blocks}: a block was lost or invented")
