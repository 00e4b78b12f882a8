"""One step's attention metadata, built once per step (not per layer) and sent in one transfer.

Every layer needs the same facts about the packed row (vLLM's ``CommonAttentionMetadata``): where each
sequence's queries start (``query_start_loc``), its context length (``seq_lens``), where this step's K/V
go in the pool (``slot_mapping``) and which blocks to read (``block_tables``). The host computes these
integer arrays with numpy -- a few integers per token and per block -- and sends them in **one** copy;
only the masks, which grow with the keys read, are made on the device. Paged attention runs one call per
:class:`AttentionGroup` -- decodes, prefills -- so a long prompt does not pad every decode to its length.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class AttentionGroup:
    """Sequences attended in one call: ``G`` sequences, ``Q`` queries each and ``K`` keys (both padded)."""

    q_index: torch.Tensor  # [G, Q] long: packed row of query j of sequence g (padding: row T, a scratch row)
    block_tables: torch.Tensor  # [G, K // block_size] long
    mask: torch.Tensor  # [G, 1, Q, K] bool: query j of sequence g may attend key position k
    rows: tuple[int, int] | None = None  # dense group (no padding): its queries are packed rows rows[0]:rows[1]


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
    attention: object = None  # Engine(attention=fn)'s function; None: the engine's own
    request_ids: list | None = None  # concat only: whose caches are gathered, in packed order
    past_key_values: object = None  # concat only: the packed DynamicCache, from the forward pass to the scatter
    non_finite_rows: list = field(default_factory=list)  # concat only: rows whose new K/V are not finite

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


def bucket(n: int) -> int:
    """The next power of two >= ``n``: the few shapes a padded dimension may take."""
    return 1 << max(0, n - 1).bit_length()


def split_by_length(members: list[int], num_blocks: list[int]) -> list[list[int]]:
    """Split one group into short and long contexts when the best cut saves at least a fifth of its
    padded area: every member is read up to the group's longest block table."""
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
    """Metadata for a packed row of ``token_ids`` (a list or 1-D CPU tensor: each sequence's scheduled
    tokens, in order). ``block_tables``: block-id lists, or a 2-D CPU tensor or numpy array whose rows hold
    ``num_blocks`` blocks each. ``bucket_shapes`` pads each group to powers of two, so a GPU meets a few
    shapes, not a new one (and its one-off setup) every step."""
    B, T = len(num_scheduled_tokens), len(token_ids)
    if B == 0 or len(num_computed_tokens) != B or sum(num_scheduled_tokens) != T or min(num_scheduled_tokens) < 1:
        raise ValueError("build() needs >= 1 sequence, each feeding >= 1 token, and one count per sequence")
    # Every integer array on the host, with numpy (a small numpy operation costs a fraction of a torch
    # one), then sent in one copy; on the device only views of it and each group's mask.
    computed = np.asarray(num_computed_tokens, dtype=np.int64)
    scheduled = np.asarray(num_scheduled_tokens, dtype=np.int64)
    qsl = np.arange(B + 1) if T == B else np.concatenate([[0], np.cumsum(scheduled)])
    seq_lens = computed + scheduled
    seq_of_token = np.arange(B) if T == B else np.repeat(np.arange(B), scheduled)
    positions = computed if T == B else np.arange(T) - qsl[seq_of_token] + computed[seq_of_token]
    ids = token_ids.numpy() if isinstance(token_ids, torch.Tensor) else np.asarray(token_ids, dtype=np.int64)
    host = [ids, positions, qsl, seq_lens, qsl[1:] - 1]
    paged = block_tables is not None
    if paged:
        tables, lengths = _as_table(block_tables, num_blocks)
        width, groups, members = _plan_groups(lengths, num_scheduled_tokens, bucket_shapes)
        tables = _padded(tables, width, lengths)
        slot_mapping = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
        keys = np.arange(max(nb for _, nb, _ in groups) * block_size)  # every key position (parts[7]), for the masks
        host += [tables.ravel(), slot_mapping, keys]
        for (q_len, nb, span), idx in zip(groups, members):
            q_index, q_pos, rows = _group_rows(idx, q_len, span, qsl, scheduled, seq_lens, T)
            host += [q_index.ravel(), q_pos.ravel(), tables[rows, :nb].ravel()]
    # The step's one host -> device transfer of metadata (from pageable memory, so a plain copy).
    flat = torch.from_numpy(np.concatenate(host)).to(device)
    parts = flat.split([len(h) for h in host])
    ids_t, positions_t, query_start_loc, seq_lens_t, logits_indices = parts[:5]
    meta = AttentionMetadata(
        num_computed_tokens=list(num_computed_tokens), num_scheduled_tokens=list(num_scheduled_tokens),
        input_ids=ids_t[None], positions=positions_t[None], query_start_loc=query_start_loc, seq_lens=seq_lens_t,
        logits_indices=logits_indices)
    if not paged:
        return meta
    meta.block_size, meta.block_tables, meta.slot_mapping = block_size, parts[5].view(B, width), parts[6]
    for k, (q_len, nb, span) in enumerate(groups):
        q_index, q_pos, tables_g = parts[8 + 3 * k:11 + 3 * k]
        q_pos = q_pos.view(-1, q_len)
        mask = (parts[7][:nb * block_size] <= q_pos[:, :, None])[:, None]  # [G, 1, Q, K]: causal, own sequence only
        packed = (int(qsl[span[0]]), int(qsl[span[1]])) if span else None
        meta.groups.append(AttentionGroup(q_index=q_index.view(-1, q_len), block_tables=tables_g.view(-1, nb),
                                          mask=mask, rows=packed))
    # Decided once per step, not once per layer: how attention lays out its queries and output.
    meta.scratch_row = any(g.rows is None for g in meta.groups)
    meta.whole_row = len(meta.groups) == 1 and meta.groups[0].rows == (0, T)
    return meta


def _group_rows(idx: list[int], q_len: int, span, qsl, scheduled, seq_lens, T: int):
    """For group ``idx`` (``-1``: a dummy): each query's packed row (padding: ``T``), its position
    (padding: 0, so it sees key 0 only), and whose block tables the group reads."""
    i = np.arange(*span) if span is not None else np.asarray(idx, dtype=np.int64)  # span: consecutive sequences
    j = np.arange(q_len)
    if span is not None or (q_len == 1 and i.min() >= 0):  # q_len queries each (decodes: one), no padding
        return qsl[i][:, None] + j, (seq_lens[i] - q_len)[:, None] + j, i
    real = i >= 0
    i = np.maximum(i, 0)
    n_sched = np.where(real, scheduled[i], 0)[:, None]
    valid = j < n_sched  # [G, Q]
    q_index = np.where(valid, qsl[i][:, None] + j, T)
    q_pos = np.where(valid, seq_lens[i][:, None] - n_sched + j, 0)
    return q_index, q_pos, i


def _as_table(block_tables, num_blocks):
    """``(table, lengths)``: the block tables as a 2-D numpy array and each row's number of blocks."""
    if isinstance(block_tables, (torch.Tensor, np.ndarray)):
        if num_blocks is None:
            raise ValueError("a block-table tensor or array needs num_blocks: how many entries of each row are blocks")
        lengths = num_blocks.tolist() if hasattr(num_blocks, "tolist") else [int(n) for n in num_blocks]
        return (block_tables.numpy() if isinstance(block_tables, torch.Tensor) else block_tables), lengths
    lengths = [len(t) for t in block_tables]
    width = max(lengths)
    return np.array([list(t) + [0] * (width - len(t)) for t in block_tables], dtype=np.int64), lengths


def _padded(tables: np.ndarray, width: int, lengths: list[int]) -> np.ndarray:
    """``tables`` cut or padded to ``width`` columns, each entry past a row's own blocks its own last block: the
    mask hides those keys, and no row reads another request's blocks (which may hold NaN: see ``may_hold_nan``)."""
    if tables.shape[1] < width:
        tables = np.concatenate([tables, np.zeros((tables.shape[0], width - tables.shape[1]), dtype=tables.dtype)], 1)
    n = np.asarray(lengths)
    last = tables[np.arange(len(n)), np.maximum(n, 1) - 1]
    return np.where(np.arange(width) < n[:, None], tables[:, :width], last[:, None])


def _plan_groups(lengths, num_scheduled_tokens, bucket_shapes):
    """The groups -- decodes (split by length unless bucketed), prefills -- from each sequence's number of
    blocks: the table width, each group's ``(q_len, num_blocks, dense span or None)`` and its members."""
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
        # Consecutive, no dummies, the same tokens each: a slice of the packed row, read as a view.
        dense = size == len(members) and members == list(range(members[0], members[-1] + 1)) and \
            all(num_scheduled_tokens[i] == q_len for i in members)
        groups.append((q_len, nb, (members[0], members[-1] + 1) if dense else None))
        members_lists.append(members + [-1] * (size - len(members)))  # -1: a dummy row, fully masked
    return width, groups, members_lists
