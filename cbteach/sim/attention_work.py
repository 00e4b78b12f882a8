"""What a step's attention reads and computes: exactly the causal past, or the engine's padded groups.

A kernel that reads each sequence's blocks where they lie (vLLM's paged attention, FlashAttention's
variable-length kernels) reads each sequence's context once and computes only the causal
(query, key) pairs: ``n x c + n (n + 1) / 2`` for a sequence with ``c`` tokens cached that feeds ``n``.
That is the ``"exact"`` layout, the one the GPU devices assume.

The cbteach engine attends with stock PyTorch instead (:mod:`cbteach.attention.paged`): it splits the
step's sequences into **groups** -- the decodes (one query each; short and long histories apart when
that saves at least a fifth of the padding, :func:`cbteach.attention.metadata.split_by_length`) and
the prefills -- and attends each group with one call, every sequence's keys gathered up to the
group's longest block table and its queries padded to the group's longest. So a group of ``G``
sequences, ``Q`` queries and ``K`` keys reads ``G x K`` tokens' K/V and computes ``G x Q x K`` pairs,
whatever the real lengths (the mask hides the padding; it does not skip it). That is the ``"groups"``
layout, the one a device calibrated on this engine uses; ``"buckets"`` also rounds each group's
sequences, queries and blocks up to powers of two (``bucket_shapes``, the engine's default on CUDA).

:func:`attention_work` follows :mod:`cbteach.attention.metadata`'s grouping rule (its public pieces
:func:`~cbteach.attention.metadata.split_by_length` and :func:`~cbteach.attention.metadata.bucket`,
the rest restated here) and a block table of ``ceil((c + n) / block_size)`` blocks per sequence.

**Scores that leave the cache.** Stock attention writes each group's scores -- ``G x Q x K`` per head --
to memory before the softmax reads them back. A small score tensor lives in the caches; a large one
(a prefill group of thousands of queries) is fresh memory every call, written and read at DRAM speed
and, past the C library's largest pooled allocation (glibc hands out blocks above 32 MiB straight from
the kernel, zeroed page by page), faulted in anew. ``spilled`` counts the (query, key) pairs of groups
whose scores for all heads exceed ``spill_pairs``. On the reference CPU a fit without them left the
held-out prefill-heavy run (four 1-2k-token prompts a step) 21% short in TTFT; charging these pairs their
own bandwidth (:func:`cbteach.sim.validate.fit_cpu`) brought it to 5% (benchmarks/sim/spill_before_after.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..attention.metadata import bucket, split_by_length
from .devices import LAYOUTS


@dataclass(frozen=True)
class AttentionWork:
    """One step's attention, per layer and per head: (query, key) ``pairs`` computed (``prefill_pairs``
    of them in groups of several queries per sequence), K/V tokens ``read`` and the ``groups`` (calls)."""

    pairs: float
    prefill_pairs: float
    read: float
    groups: int
    spilled: float = 0.0  # pairs of the groups whose score tensor is larger than ``spill_pairs``


def attention_work(num_computed_tokens, num_scheduled_tokens, layout: str = "exact", block_size: int = 16,
                   spill_pairs: float | None = None) -> AttentionWork:
    """The attention work of a step feeding ``num_scheduled_tokens[i]`` tokens to sequence ``i``, which has
    ``num_computed_tokens[i]`` cached, in ``layout`` (:data:`LAYOUTS`). With ``spill_pairs``, the pairs of
    the groups that compute more than that many (per head) are also counted as ``spilled`` (padded
    layouts only: an exact kernel keeps its scores on chip)."""
    if layout == "exact":
        pairs = prefill = 0.0
        for c, n in zip(num_computed_tokens, num_scheduled_tokens):
            p = n * c + n * (n + 1) / 2
            pairs += p
            prefill += p if n > 1 else 0.0
        read = sum(c + n for c, n in zip(num_computed_tokens, num_scheduled_tokens))
        return AttentionWork(pairs, prefill, float(read), int(bool(read)))
    if layout not in LAYOUTS:
        raise ValueError(f"attention layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    bucketed = layout == "buckets"
    blocks = [-(-(c + n) // block_size) for c, n in zip(num_computed_tokens, num_scheduled_tokens)]
    width = bucket(max(blocks)) if bucketed else max(blocks, default=0)
    decodes = [i for i, n in enumerate(num_scheduled_tokens) if n == 1]
    prefills = [i for i, n in enumerate(num_scheduled_tokens) if n > 1]
    split = [decodes] if bucketed else split_by_length(decodes, [blocks[i] for i in decodes])
    pairs = prefill = read = spilled = 0.0
    groups = 0
    for members, several in [(m, False) for m in split] + [(prefills, True)]:
        if not members:
            continue
        size, q, nb = len(members), max(num_scheduled_tokens[i] for i in members), max(blocks[i] for i in members)
        if bucketed:
            size, q, nb = bucket(size), bucket(q), min(bucket(nb), width)
        keys = nb * block_size
        groups += 1
        read += size * keys
        pairs += size * q * keys
        prefill += size * q * keys if several else 0.0
        spilled += size * q * keys if spill_pairs is not None and size * q * keys > spill_pairs else 0.0
    return AttentionWork(pairs, prefill, read, groups, spilled)
