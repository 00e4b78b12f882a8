"""One step's attention metadata: built once per step, moved to the device in one transfer.

Every layer of the model needs the same facts about the packed row: where each sequence's queries
start, how long each sequence's context is, where this step's keys and values go in the paged pool
(the **slot mapping**) and which blocks to read (the **block tables**). Computing them once per
step -- not once per layer, not with Python loops over tokens -- is what production engines do
(vLLM's ``CommonAttentionMetadata``: ``query_start_loc``, ``seq_lens``, ``block_table_tensor``,
``slot_mapping``). The host sends a handful of short integer lists in **one** copy; everything
that grows with the number of tokens (positions, slot mapping, masks) is computed from them on
the device.

For the vectorised paged attention the sequences are split into :class:`AttentionGroup`\\ s --
*decodes* (one query each; short and long histories apart when that saves much padding, see
:func:`split_by_length`) and *prefills* (several) -- each attended with a single call: queries
padded to the group's longest, keys read through the group's block tables and padded to its
longest context, and a mask that keeps every query inside its own sequence's causal past.
Separate groups keep a long prompt from padding every decode in the step to its length.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionGroup:
    """Sequences attended together. ``G`` sequences, ``Q`` queries each (padded), ``K`` keys (padded).

    ``q_index[g, j]`` is the row of the packed batch holding query ``j`` of the group's sequence
    ``g``; padding points at row ``T`` (one past the end: a scratch row that is never read back).
    ``mask[g, 0, j, k]`` is True when that query may attend key position ``k``. A *dense* group --
    consecutive sequences feeding ``Q`` tokens each, no padding, like the decodes of a step -- also
    has ``rows``: its queries are that slice of the packed row, so attention takes a view of them
    instead of gathering (and writes its output back as a slice).
    """

    q_index: torch.Tensor  # [G, Q] long
    block_tables: torch.Tensor  # [G, K // block_size] long
    mask: torch.Tensor  # [G, 1, Q, K] bool
    rows: tuple[int, int] | None = None  # dense group: its queries are packed rows rows[0]:rows[1], in order


@dataclass
class AttentionMetadata:
    """What one forward pass needs; tensors are on the model's device."""

    num_computed_tokens: list[int]  # per sequence, host copy (tokens already in the KV cache)
    num_scheduled_tokens: list[int]  # per sequence, host copy (tokens fed this step)
    input_ids: torch.Tensor  # [1, T]
    positions: torch.Tensor  # [1, T]: each token's position inside its own sequence
    query_start_loc: torch.Tensor  # [B + 1]: sequence i owns rows query_start_loc[i]:query_start_loc[i+1]
    seq_lens: torch.Tensor  # [B]: context length after this step (computed + scheduled)
    logits_indices: torch.Tensor  # [B]: row of each sequence's last token, whose logits we sample
    block_size: int | None = None  # paged only, from here down
    slot_mapping: torch.Tensor | None = None  # [T]: pool slot where each new token's K/V are written
    block_tables: torch.Tensor | None = None  # [B, max_blocks]; entries past a sequence's own blocks are never read
    groups: list[AttentionGroup] = field(default_factory=list)
    scratch_row: bool = False  # some group gathers padded queries: attention adds a zero row T for them
    whole_row: bool = False  # one dense group holds every packed row: its output is the step's output
    pool: object = None  # the PagedKVPool the attention function reads and writes
    attention: object = None  # a plugged-in attention function (Engine(attention=...)); None: the engine's
    request_ids: list | None = None  # concat only: whose caches are gathered, in packed order
    past_key_values: object = None  # concat only: the packed DynamicCache, from the forward pass to the scatter

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


def bucket(n: int) -> int:
    """The next power of two >= ``n``: the few shapes a padded dimension may take."""
    return 1 << max(0, n - 1).bit_length()


def split_by_length(members: list[int], num_blocks: list[int]) -> list[list[int]]:
    """Split one group in two where that saves much padding: short and long contexts apart.

    Every sequence of a group is read up to the group's longest block table, so one long history
    makes every short one pay for its length. Sorted by length, the best cut (least padded area)
    is taken if it saves at least a fifth -- still at most three attention calls per layer.
    """
    if len(members) < 2:
        return [members]
    order = sorted(range(len(members)), key=lambda j: num_blocks[j])
    nb = [num_blocks[j] for j in order]
    whole = len(nb) * nb[-1]
    cut = min(range(1, len(nb)), key=lambda i: i * nb[i - 1] + (len(nb) - i) * nb[-1])
    if cut * nb[cut - 1] + (len(nb) - cut) * nb[-1] > 0.8 * whole:
        return [members]
    return [[members[j] for j in order[:cut]], [members[j] for j in order[cut:]]]


def build(token_ids, num_computed_tokens: list[int], num_scheduled_tokens: list[int], device,
          block_tables=None, block_size: int | None = None, bucket_shapes: bool = False,
          num_blocks: list[int] | None = None) -> AttentionMetadata:
    """Metadata for a packed row of ``token_ids`` (each sequence's scheduled tokens, in order).

    ``token_ids`` is a list or a 1-D CPU tensor; ``block_tables`` a list of block-id lists, or a 2-D
    CPU tensor with one row per sequence and ``num_blocks`` saying how many entries of each row are
    its blocks (the worker's persistent block table: :mod:`cbteach.worker.block_table`).

    ``bucket_shapes`` pads each attention group's sequences, queries and blocks up to powers of two
    with masked dummies. On a GPU every new tensor shape can cost a one-off setup (kernel plans,
    autotuning); with buckets a run meets a handful of shapes instead of a new one every step.
    """
    B = len(num_scheduled_tokens)
    T = len(token_ids)
    if B == 0 or len(num_computed_tokens) != B or sum(num_scheduled_tokens) != T or min(num_scheduled_tokens) < 1:
        raise ValueError("build() needs >= 1 sequence, each feeding >= 1 token, and one count per sequence")
    # Per-sequence facts are a few integers each: the host computes them (vLLM does too).
    qsl = [0, *itertools.accumulate(num_scheduled_tokens)]
    seq_lens = [c + n for c, n in zip(num_computed_tokens, num_scheduled_tokens)]
    host = [torch.as_tensor(token_ids, dtype=torch.long),
            torch.tensor([*num_computed_tokens, *num_scheduled_tokens, *qsl, *seq_lens], dtype=torch.long)]
    paged = block_tables is not None
    groups: list = []
    if paged:
        tables, lengths = _as_table(block_tables, num_blocks)
        width, groups, members = _plan_groups(lengths, num_scheduled_tokens, bucket_shapes)
        host += [_padded(tables, width).flatten(), torch.tensor([m for ms in members for m in ms], dtype=torch.long)]
    # The step's one host -> device transfer of metadata (from pageable memory, so a plain copy).
    flat = torch.cat(host).to(device)
    split = [T, B, B, B + 1, B] + ([B * width] + [len(m) for m in members] if paged else [])
    ids, computed, scheduled, query_start_loc, seq_lens_t, *rest = flat.split(split)

    # Per-token facts grow with the batch: computed on the device from the per-sequence ones.
    if T == B:  # a pure decode step, the common case: row i is sequence i's token at position computed[i]
        seq_of_token, positions = torch.arange(B, device=device), computed
    else:
        seq_of_token = torch.repeat_interleave(torch.arange(B, device=device), scheduled, output_size=T)
        positions = torch.arange(T, device=device) + (computed - query_start_loc[:-1])[seq_of_token]
    meta = AttentionMetadata(
        num_computed_tokens=list(num_computed_tokens), num_scheduled_tokens=list(num_scheduled_tokens),
        input_ids=ids[None], positions=positions[None], query_start_loc=query_start_loc, seq_lens=seq_lens_t,
        logits_indices=query_start_loc[1:] - 1)
    if not paged:
        return meta
    tables = rest[0].view(B, width)
    meta.block_size, meta.block_tables = block_size, tables
    meta.slot_mapping = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    for (q_len, nb, span), idx in zip(groups, rest[1:]):
        rows = (qsl[span[0]], qsl[span[1]]) if span else None
        meta.groups.append(_group(meta, idx, q_len, nb, T, span, rows))
    # Decided once per step, not once per layer: how attention lays out its queries and output.
    meta.scratch_row = any(g.rows is None for g in meta.groups)
    meta.whole_row = len(meta.groups) == 1 and meta.groups[0].rows == (0, T)
    return meta


def _as_table(block_tables, num_blocks):
    """``(table, lengths)``: the block tables as a 2-D tensor and each row's number of blocks."""
    if isinstance(block_tables, torch.Tensor):
        if num_blocks is None:
            raise ValueError("a block-table tensor needs num_blocks: how many entries of each row are blocks")
        return block_tables, [int(n) for n in num_blocks]
    lengths = [len(t) for t in block_tables]
    width = max(lengths)
    return torch.tensor([list(t) + [0] * (width - len(t)) for t in block_tables], dtype=torch.long), lengths


def _padded(tables: torch.Tensor, width: int) -> torch.Tensor:
    """``tables`` cut (or padded with block 0) to ``width`` columns; entries past a row's own blocks are
    never read (the mask hides their keys), whatever ids they hold."""
    if tables.shape[1] >= width:
        return tables[:, :width]
    return torch.cat([tables, tables.new_zeros(tables.shape[0], width - tables.shape[1])], dim=1)


def _plan_groups(lengths, num_scheduled_tokens, bucket_shapes):
    """Decide the attention groups on the host: decodes (split by length unless shapes are
    bucketed) and prefills. ``lengths``: each sequence's number of blocks. Returns the block-table
    width, each group's ``(q_len, num_blocks, dense span or None)`` and its member list (``-1``: a dummy)."""
    width = max(lengths)
    width = bucket(width) if bucket_shapes else width
    decodes = [i for i, n in enumerate(num_scheduled_tokens) if n == 1]
    prefills = [i for i, n in enumerate(num_scheduled_tokens) if n > 1]
    split = [decodes] if bucket_shapes else split_by_length(decodes, [lengths[i] for i in decodes])
    groups, members_lists = [], []
    for members in split + [prefills]:
        if not members:
            continue
        q_len, nb, size = (max(num_scheduled_tokens[i] for i in members),
                           max(lengths[i] for i in members), len(members))
        if bucket_shapes:
            size, q_len, nb = bucket(size), bucket(q_len), min(bucket(nb), width)
        # Consecutive sequences feeding the same number of tokens, no dummies: their queries are
        # a slice of the packed row, which attention reads as a view instead of gathering it.
        dense = size == len(members) and members == list(range(members[0], members[-1] + 1)) and \
            all(num_scheduled_tokens[i] == q_len for i in members)
        groups.append((q_len, nb, (members[0], members[-1] + 1) if dense else None))
        members_lists.append(members + [-1] * (size - len(members)))  # -1: a dummy row, fully masked
    return width, groups, members_lists


def _group(meta: AttentionMetadata, idx: torch.Tensor, q_len: int, nb: int, T: int, span, rows) -> AttentionGroup:
    """``idx``: the group's sequences (``-1`` for dummy rows); ``q_len`` queries, ``nb`` blocks each.
    ``span``/``rows``: for a dense group, its sequences ``span[0]:span[1]`` and their packed rows."""
    device = idx.device
    j = torch.arange(q_len, device=device)  # [Q]
    keys = torch.arange(nb * meta.block_size, device=device)  # [K]
    if rows is not None:  # consecutive sequences, q_len queries each, no padding: slices, no gathers
        first, last = span
        q_index = torch.arange(*rows, device=device).view(-1, q_len)
        q_pos = (meta.seq_lens[first:last] - q_len)[:, None] + j  # [G, Q]: each query's position
        tables = meta.block_tables[first:last, :nb]
    else:
        real = (idx >= 0)[:, None]
        i = idx.clamp(min=0)
        n_sched = torch.where(real, (meta.query_start_loc[i + 1] - meta.query_start_loc[i])[:, None], 0)
        valid = j < n_sched  # [G, Q]
        q_index = torch.where(valid, meta.query_start_loc[i][:, None] + j, T)  # padding -> scratch row T
        q_pos = torch.where(valid, (meta.seq_lens[i][:, None] - n_sched) + j, 0)  # padding sees key 0 only
        tables = meta.block_tables[i, :nb]
    mask = (keys <= q_pos[:, :, None])[:, None]  # [G, 1, Q, K]: causal, own sequence only
    return AttentionGroup(q_index=q_index, block_tables=tables, mask=mask, rows=rows)
