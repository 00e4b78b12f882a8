"""Pieces plugged into ``serve`` by the tests (``--scheduler server_pieces:PlainScheduler`` ...): each one is
the engine's own behaviour written out by hand, so answers must stay exactly ``generate``'s. Each notes in
the file ``$CBTEACH_PIECES_LOG`` (if set) that the engine core called it, once per process."""
import os

from cbteach.attention.paged import default_attention
from cbteach.engine.scheduler import Scheduler
from cbteach.kv.manager import KVCacheManager

_noted = set()


def _note(what: str) -> None:
    path = os.environ.get("CBTEACH_PIECES_LOG")
    if path and what not in _noted:
        _noted.add(what)
        with open(path, "a") as f:
            f.write(f"{what} {os.getpid()}\n")


class PlainScheduler(Scheduler):
    """The engine's scheduler, as a learner's subclass would start."""

    def schedule(self, now):
        _note("scheduler")
        return super().schedule(now)


class PlainKVManager(KVCacheManager):
    """The engine's KV manager, built as serve builds one: PlainKVManager(num_blocks, block_size)."""

    def __init__(self, num_blocks, block_size):
        _note("kv_manager")
        super().__init__(num_blocks, block_size)


def attention(query, key, value, meta, layer, scaling=None):
    _note("attention")
    return default_attention(query, key, value, meta, layer, scaling)


def slot_mapping(block_tables, num_computed_tokens, num_scheduled_tokens, block_size):
    _note("slot_mapping")
    return [table[p // block_size] * block_size + p % block_size
            for table, c, n in zip(block_tables, num_computed_tokens, num_scheduled_tokens) for p in range(c, c + n)]
