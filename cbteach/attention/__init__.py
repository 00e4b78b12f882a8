"""Attention for a packed step (notebooks 03 and 05).

* :mod:`.packing` -- one unpadded row: position ids and the block-diagonal causal mask
* :mod:`.metadata` -- everything attention needs about a step, built once per step (vLLM's attention metadata)
* :mod:`.paged` -- paged attention, registered through transformers' ``AttentionInterface``
* :mod:`.reference` -- the readable loop over sequences the engine's paged attention is checked against
"""
