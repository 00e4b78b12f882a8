"""Notebook 05: a token's slot in the paged pool, and the empty slots of a last block."""
from __future__ import annotations

from types import SimpleNamespace

from ..kv_paged import PagedKVCache
from . import report

BLOCK_SIZE, TABLE, POSITION, LENGTH = 16, [7, 2, 11], 37, 45


def check_slot(slot, empty) -> bool:
    """Compare with the engine's own slot computation (``PagedKVCache.slots``)."""
    cache = PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=16, block_size=BLOCK_SIZE)
    seq = SimpleNamespace(block_table=TABLE)
    expected = cache.slots(seq, POSITION, POSITION + 1).item()
    expected_empty = len(TABLE) * BLOCK_SIZE - LENGTH
    ok_slot = slot == expected
    if not ok_slot:
        block = POSITION // BLOCK_SIZE
        hint = (f"position {POSITION} is in table entry {block} (= block {TABLE[block]}) at offset "
                f"{POSITION % BLOCK_SIZE}" if slot != TABLE[block] * BLOCK_SIZE + POSITION % BLOCK_SIZE else "")
        if slot == block * BLOCK_SIZE + POSITION % BLOCK_SIZE:
            hint = "you used the table index, not the block id it holds"
        report(False, "", f"slot {slot!r} is wrong: {hint or 'slot = block_table[pos // B] * B + pos % B'}")
    if empty != expected_empty:
        report(False, "", f"empty={empty!r} is wrong: the table's blocks hold {len(TABLE) * BLOCK_SIZE} slots "
                          f"for {LENGTH} tokens")
    if ok_slot and empty == expected_empty:
        return report(True, f"slot {expected}, and {expected_empty} empty slots: only a sequence's last block "
                            "is ever partly empty", "")
    return False
