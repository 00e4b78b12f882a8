"""The paged cache running a learner's attention and slot mapping (notebooks 05 and 12).

``Engine(..., kv="paged", attention=my_attention, slot_mapping=my_slot_mapping)`` builds this cache
instead of :class:`~cbteach.kv.paged.PagedKVCache`: every step's metadata carries the learner's
attention function (the model's layers call it instead of
:func:`cbteach.attention.paged.default_attention`), and the learner's slot mapping is computed beside
the engine's and used only if it agrees -- a token's K/V in the wrong slot would silently corrupt
someone's context, so a disagreement stops the step with :class:`~cbteach.errors.EngineRuleError`.
"""
from __future__ import annotations

import torch

from ..errors import EngineRuleError
from .paged import PagedKVCache


class PluggedPagedKVCache(PagedKVCache):
    """:class:`~cbteach.kv.paged.PagedKVCache` with a learner's pieces plugged in (see the module)."""

    attention = None
    slot_mapping = None

    def plug(self, attention=None, slot_mapping=None) -> None:
        """``attention(query, key, value, meta, layer, scaling)`` instead of the engine's, and
        ``slot_mapping(block_tables, num_computed_tokens, num_scheduled_tokens, block_size)`` (a list of
        pool slots, one per scheduled token in packed order) beside the engine's."""
        for name, fn in (("attention", attention), ("slot_mapping", slot_mapping)):
            if fn is not None and not callable(fn):
                raise ValueError(f"{name} must be a function, got {type(fn).__name__}")
        self.attention, self.slot_mapping = attention, slot_mapping

    def build_metadata(self, token_ids, num_computed, num_scheduled, device, block_tables=None, num_blocks=None,
                       request_ids=None):
        meta = super().build_metadata(token_ids, num_computed, num_scheduled, device, block_tables=block_tables,
                                      num_blocks=num_blocks, request_ids=request_ids)
        meta.attention = self.attention
        if self.slot_mapping is not None:
            tables = ([row[:n].tolist() for row, n in zip(block_tables, num_blocks)] if num_blocks is not None
                      else [list(t) for t in block_tables])
            meta.slot_mapping = self._checked_slot_mapping(meta, tables, num_computed, num_scheduled)
        return meta

    def _checked_slot_mapping(self, meta, tables, num_computed, num_scheduled):
        """The learner's slot mapping, if it puts every token where the engine would."""
        got = self.slot_mapping([list(t) for t in tables], list(num_computed), list(num_scheduled), self.block_size)
        try:
            mine = torch.as_tensor(list(got), dtype=torch.long, device=meta.slot_mapping.device)
        except (TypeError, ValueError, RuntimeError):
            shape = f" of shape {tuple(got.shape)}" if hasattr(got, "shape") else ""
            raise EngineRuleError(f"slot_mapping returned {type(got).__name__}{shape}: return one pool slot (an int) per "
                                  "scheduled token, in packed order -- a flat list or a 1-D tensor") from None
        if mine.shape != meta.slot_mapping.shape:
            raise EngineRuleError(f"slot_mapping returned {mine.numel()} slots for {meta.slot_mapping.numel()} "
                                  "scheduled tokens: one slot per token fed this step, in packed order")
        wrong = (mine != meta.slot_mapping).nonzero()
        if len(wrong):
            t = int(wrong[0])
            i = int((meta.query_start_loc[1:] <= t).sum())
            raise EngineRuleError(f"slot_mapping put token {t - int(meta.query_start_loc[i])} of sequence {i} (position "
                                  f"{int(meta.positions[0, t])}) where its block table does not: the engine stopped "
                                  "rather than write K/V over another token's (run notebook 05's check)")
        return mine
