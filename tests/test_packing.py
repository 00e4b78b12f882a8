"""Ragged packing and the two mask layouts, checked against a brute-force definition."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cbteach.attention.packing import additive_mask, block_diagonal_causal_mask, pack, per_sequence_causal_mask

lengths = st.lists(st.tuples(st.integers(0, 6), st.integers(1, 5)), min_size=0, max_size=5)


def brute_force(num_computed_tokens, num_scheduled_tokens, layout):
    """Spell out every (query, key) pair: same sequence and key position <= query position."""
    queries = [(s, c + j) for s, (c, n) in enumerate(zip(num_computed_tokens, num_scheduled_tokens)) for j in range(n)]
    if layout == "concat":
        keys = [(s, p) for s, c in enumerate(num_computed_tokens) for p in range(c)]
        keys += [(s, c + j) for s, (c, n) in enumerate(zip(num_computed_tokens, num_scheduled_tokens)) for j in range(n)]
    else:
        keys = [(s, p) for s, (c, n) in enumerate(zip(num_computed_tokens, num_scheduled_tokens)) for p in range(c + n)]
    return torch.tensor([[qs == ks and kp <= qp for ks, kp in keys] for qs, qp in queries],
                        dtype=torch.bool).reshape(len(queries), len(keys))


@given(lengths)
@settings(max_examples=60, derandomize=True)
def test_masks_match_definition(seqs):
    cached = [c for c, _ in seqs]
    new = [n for _, n in seqs]
    assert torch.equal(block_diagonal_causal_mask(cached, new), brute_force(cached, new, "concat"))
    assert torch.equal(per_sequence_causal_mask(cached, new), brute_force(cached, new, "paged"))


def test_pack_positions_and_offsets():
    b = pack([[5, 6, 7], [8], [9, 10]], [0, 4, 2])
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9, 10]]
    assert b.position_ids.tolist() == [[0, 1, 2, 4, 2, 3]]
    assert b.query_start_loc == [0, 3, 4, 6]
    assert b.logits_indices == [2, 3, 5]


def test_pack_rejects_empty_chunk_and_mismatch():
    with pytest.raises(ValueError, match="at least one token"):
        pack([[1], []], [0, 0])
    with pytest.raises(ValueError, match="one num_computed_tokens entry per chunk"):
        pack([[1]], [0, 0])
    with pytest.raises(ValueError, match="num_computed_tokens has 1 entries but num_scheduled_tokens has 2"):
        block_diagonal_causal_mask([1], [1, 1])


def test_additive_mask_is_finite_and_blocks():
    m = additive_mask(block_diagonal_causal_mask([1, 0], [1, 2]), torch.float32)
    assert m.shape == (1, 1, 3, 4)
    assert torch.isfinite(m).all()
    weights = torch.softmax(m[0, 0], dim=-1)
    assert weights[0, 2] == 0 and weights[1, 0] == 0 and weights[1, 3] == 0 and weights[2, 3] > 0
