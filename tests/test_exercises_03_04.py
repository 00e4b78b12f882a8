"""Self-checks of notebooks 03 and 04: right answers pass, wrong ones fail and say what is wrong."""
import pytest
import torch

from cbteach.exercises.ex03 import check_mask, check_position_ids, key_labels
from cbteach.exercises.ex04 import check_gather_scatter
from cbteach.attention.packing import block_diagonal_causal_mask, per_sequence_causal_mask

CACHED, NEW = [2, 0, 3], [1, 3, 1]


def by_hand(cached, new):
    """The notebook's solution: positions and the concat-layout mask from the definition."""
    positions = [c + j for c, n in zip(cached, new) for j in range(n)]
    query_seq = [s for s, n in enumerate(new) for _ in range(n)]
    keys = [(s, p) for s, c in enumerate(cached) for p in range(c)]
    keys += [(s, c + j) for s, (c, n) in enumerate(zip(cached, new)) for j in range(n)]
    mask = torch.tensor([[ks == qs and kp <= qp for ks, kp in keys] for qs, qp in zip(query_seq, positions)])
    return positions, mask


# -- notebook 03 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("cached,new", [(CACHED, NEW), ([0], [4]), ([5, 1], [1, 1]), ([0, 0, 7, 2], [2, 3, 1, 4])])
def test_hand_written_answers_pass(cached, new, capsys):
    positions, mask = by_hand(cached, new)
    assert check_position_ids(cached, new, positions)
    assert check_position_ids(cached, new, torch.tensor([positions]))  # the [1, T] shape pack() returns
    assert check_mask(cached, new, mask)
    assert check_mask(cached, new, mask.tolist())
    assert check_mask(cached, new, mask[None, None])  # [1, 1, Q, K] is accepted too
    assert capsys.readouterr().out.count("✓") == 5


def test_right_answers_in_other_forms_pass(capsys):
    """Right answers a learner writes in another form were refused as not "a list of integers" or not "a boolean
    tensor": a tuple, a list of 0-d tensors, a list of row tensors, a ``[1, Q, K]`` mask."""
    positions, mask = by_hand(CACHED, NEW)
    for answer in (tuple(positions), list(torch.tensor(positions)), (p for p in positions)):
        assert check_position_ids(CACHED, NEW, answer), capsys.readouterr().out
    for answer in (list(mask), mask[None], tuple(tuple(row) for row in mask.tolist())):
        assert check_mask(CACHED, NEW, answer), capsys.readouterr().out


def test_wrong_positions_name_the_mistake_not_the_entries(capsys):
    assert not check_position_ids(CACHED, NEW, [0, 1, 2, 3, 4])
    out = capsys.readouterr().out
    assert "✗" in out and "one long sequence" in out
    assert "row index" not in out and "you wrote" not in out  # no entry by entry listing
    assert not check_position_ids(CACHED, NEW, [0, 0, 1, 2, 0])
    assert "num_computed_tokens" in capsys.readouterr().out
    assert not check_position_ids(CACHED, NEW, [2, 0, 1, 2, 4])  # C starts one too high
    out = capsys.readouterr().out
    assert "sequence C's positions start too high" in out and "sequence A" not in out
    assert not check_position_ids(CACHED, NEW, [2, 0, 2, 1, 3])  # B does not count up
    assert "sequence B's positions do not count up" in capsys.readouterr().out
    assert not check_position_ids(CACHED, NEW, [2, 0, 1])
    assert "needs 5 position ids" in capsys.readouterr().out
    assert not check_position_ids(CACHED, NEW, "2 0 1 2 3")
    assert "list of 5 integers" in capsys.readouterr().out


@pytest.mark.parametrize("answer", [[2.0, 0.0, 1.0, 2.0, 3.0], torch.tensor([[2.0, 0.0, 1.0, 2.0, 3.0]]),
                                    torch.arange(5.0)])
def test_float_positions_are_named_as_floats(answer, capsys):
    assert not check_position_ids(CACHED, NEW, answer)
    out = capsys.readouterr().out
    assert "the position ids are floats" in out and "list of 5 integers" not in out, out


def _flipped(i, j):
    mask = block_diagonal_causal_mask(CACHED, NEW).clone()
    mask[i, j] = not mask[i, j]
    return mask


# queries: A p2 | B p0 B p1 B p2 | C p3; keys: A p0 A p1 C p0 C p1 C p2 (cached) | A p2 B p0 B p1 B p2 C p3 (new)
@pytest.mark.parametrize("i, j, words", [
    (1, 0, "another sequence"),        # B p0 sees A's cached p0
    (4, 6, "another sequence"),        # C p3 sees B's new p0
    (1, 7, "later key of its own"),    # B p0 sees B p1
    (0, 0, "sits in the cache"),       # A p2 kept from its cached p0
    (2, 6, "computed in this same step"),  # B p1 kept from B p0
    (3, 8, "its own key"),             # B p2 kept from itself
])
def test_each_kind_of_wrong_mask_entry_is_named_without_coordinates(capsys, i, j, words):
    assert not check_mask(CACHED, NEW, _flipped(i, j))
    out = capsys.readouterr().out
    assert out.startswith("✗") and words in out
    assert " p0" not in out and " p1" not in out and "query B" not in out and "of 50" not in out


def test_two_kinds_at_once_are_both_named(capsys):
    mask = _flipped(1, 0)
    mask[1, 7] = True
    assert not check_mask(CACHED, NEW, mask)
    out = capsys.readouterr().out
    assert "another sequence" in out and "later key" in out


def test_mask_hints(capsys):
    q, k = sum(NEW), sum(CACHED) + sum(NEW)
    assert not check_mask(CACHED, NEW, torch.ones(q, k, dtype=torch.bool).tril(k - q))
    assert "plain causal" in capsys.readouterr().out
    assert not check_mask(CACHED, NEW, per_sequence_causal_mask(CACHED, NEW))
    assert "per-sequence layout" in capsys.readouterr().out
    assert not check_mask(CACHED, NEW, torch.ones(q, sum(NEW), dtype=torch.bool).tril())
    assert "include the 5 cached" in capsys.readouterr().out
    assert not check_mask(CACHED, NEW, block_diagonal_causal_mask(CACHED, NEW).float())
    out = capsys.readouterr().out  # 1.0 / 0.0: told about the type, not sent to the additive form
    assert "boolean mask" in out and "dtype=torch.bool" in out and "additive_mask" not in out
    additive = torch.zeros(q, k).masked_fill(~block_diagonal_causal_mask(CACHED, NEW), float("-inf"))
    assert not check_mask(CACHED, NEW, additive)
    assert "additive_mask() makes the 0 / -inf form" in capsys.readouterr().out
    right, c = block_diagonal_causal_mask(CACHED, NEW), sum(CACHED)
    assert not check_mask(CACHED, NEW, ~right)
    assert "the mask inverted" in capsys.readouterr().out
    assert not check_mask(CACHED, NEW, right.T)
    assert "transposed" in capsys.readouterr().out
    assert not check_mask(CACHED, NEW, torch.cat([right[:, c:], right[:, :c]], dim=1))
    assert "[all new | all cached]" in capsys.readouterr().out


def test_key_labels_follow_the_concat_layout():
    assert key_labels(CACHED, NEW) == ["A p0 (cached)", "A p1 (cached)", "C p0 (cached)", "C p1 (cached)",
                                       "C p2 (cached)", "A p2 (new)", "B p0 (new)", "B p1 (new)", "B p2 (new)",
                                       "C p3 (new)"]


def test_bad_lengths_are_reported_not_raised(capsys):
    assert not check_mask([1, 2], [1], torch.zeros(1, 4, dtype=torch.bool))
    assert "one cached length" in capsys.readouterr().out
    assert not check_position_ids([1], [0], [])
    assert "one cached length" in capsys.readouterr().out


# -- notebook 04 ---------------------------------------------------------------------------------
def gather(caches):
    """The notebook's solution."""
    parts = [c for c in caches if c is not None]
    if not parts:
        return None
    return torch.cat([k for k, _ in parts], dim=2), torch.cat([v for _, v in parts], dim=2)


def scatter(packed_keys, packed_values, caches, num_scheduled):
    start = sum(c[0].shape[2] for c in caches if c is not None)
    new_k = packed_keys[:, :, start:].split(num_scheduled, dim=2)
    new_v = packed_values[:, :, start:].split(num_scheduled, dim=2)
    return [(k.clone(), v.clone()) if old is None else (torch.cat([old[0], k], dim=2), torch.cat([old[1], v], dim=2))
            for old, k, v in zip(caches, new_k, new_v)]


@pytest.fixture(scope="module")
def bierce_model():
    from cbteach import load_model
    return load_model()


def test_gather_scatter_solution_passes_inside_the_engine(bierce_model, capsys):
    model, tok = bierce_model
    assert check_gather_scatter(gather, scatter, model, tok)
    out = capsys.readouterr().out
    assert out.startswith("✓") and "fused" in out and "(0 fused)" not in out


def test_a_scatter_that_yields_its_pairs_passes(bierce_model, capsys):
    """``yield`` one pair per sequence was "should return one (keys, values) pair per sequence" -- which it did."""
    def yielding(packed_keys, packed_values, caches, num_scheduled):
        yield from scatter(packed_keys, packed_values, caches, num_scheduled)

    assert check_gather_scatter(gather, yielding, *bierce_model), capsys.readouterr().out


def _g_dim(caches):
    parts = [c for c in caches if c is not None]
    return (torch.cat([k for k, _ in parts], dim=1), torch.cat([v for _, v in parts], dim=1)) if parts else None


def _g_reversed(caches):
    return gather(list(reversed(caches)))


def _g_swapped(caches):
    got = gather(caches)
    return None if got is None else (got[1], got[0])


def _g_no_none(caches):
    return torch.cat([c[0] for c in caches], dim=2), torch.cat([c[1] for c in caches], dim=2)


def _g_empty(caches):
    got = gather(caches)
    return got if got is not None else (torch.zeros(1, 2, 0, 3), torch.zeros(1, 2, 0, 3))


def _g_none_if_any_uncached(caches):  # "nothing cached" read as "some sequence has nothing cached"
    return None if None in caches else gather(caches)


def _s_values_from_keys(pk, pv, caches, num_scheduled):  # copy and paste: the values cut from the keys
    return [(k, k2) for (k, _), (k2, _) in zip(scatter(pk, pv, caches, num_scheduled),
                                               scatter(pk, pk, caches, num_scheduled))]


def _s_values_misplaced(pk, pv, caches, num_scheduled):  # the keys right, the values in reverse order
    return [(k, v.flip(2)) for k, v in scatter(pk, pv, caches, num_scheduled)]


def _s_from_start(pk, pv, caches, num_scheduled):  # the new keys cut from the front of the packed cache
    new_k, new_v = pk.split(num_scheduled + [pk.shape[2] - sum(num_scheduled)], dim=2)[:-1], pv.split(
        num_scheduled + [pv.shape[2] - sum(num_scheduled)], dim=2)[:-1]
    return [(k, v) if old is None else (torch.cat([old[0], k], 2), torch.cat([old[1], v], 2))
            for old, k, v in zip(caches, new_k, new_v)]


def _s_off_by_one(pk, pv, caches, num_scheduled):
    start = sum(c[0].shape[2] for c in caches if c is not None) - 1
    ks = pk[:, :, start:start + sum(num_scheduled)].split(num_scheduled, dim=2)
    vs = pv[:, :, start:start + sum(num_scheduled)].split(num_scheduled, dim=2)
    return [(k, v) if old is None else (torch.cat([old[0], k], 2), torch.cat([old[1], v], 2))
            for old, k, v in zip(caches, ks, vs)]


def _s_overwrite(pk, pv, caches, num_scheduled):
    start = sum(c[0].shape[2] for c in caches if c is not None)
    return list(zip(pk[:, :, start:].split(num_scheduled, dim=2), pv[:, :, start:].split(num_scheduled, dim=2)))


def _s_split_by_cached(pk, pv, caches, num_scheduled):
    cached = [0 if c is None else c[0].shape[2] for c in caches]
    start = sum(cached)
    sizes = [max(c, 1) for c in cached]
    sizes[-1] = pk.shape[2] - start - sum(sizes[:-1])
    return scatter(pk, pv, caches, sizes) if sizes[-1] > 0 else scatter(pk, pv, caches, num_scheduled)[::-1]


def _s_all_new(pk, pv, caches, num_scheduled):
    start = sum(c[0].shape[2] for c in caches if c is not None)
    k, v = pk[:, :, start:], pv[:, :, start:]
    return [(k, v) if old is None else (torch.cat([old[0], k], 2), torch.cat([old[1], v], 2)) for old in caches]


def _s_swapped(pk, pv, caches, num_scheduled):
    return [(v, k) for k, v in scatter(pk, pv, caches, num_scheduled)]


class _LateBug:
    """Right on the check's labelled step; inside the engine, from its second call on, drops the last
    sequence's new token -- only running it in the engine can catch that."""
    calls = 0

    def __call__(self, pk, pv, caches, num_scheduled):
        self.calls += 1
        out = scatter(pk, pv, caches, num_scheduled)
        if self.calls > 2 and caches[-1] is not None:
            out[-1] = caches[-1]
        return out


WRONG_GATHER = [(_g_dim, "raised RuntimeError"), (_g_dim, "they are joined along the token axis"),
                (lambda c: [(k, v) for k, v in (x for x in c if x is not None)],  # a list of pairs (was "it raised")
                 "gather, on a step with sequences of 3, 0 and 2 cached tokens: gather's result should be a (keys, "
                 "values) pair of tensors, got list"), (_g_reversed, "another order"), (_g_swapped, "swapped"),
                (_g_no_none, "its entry in caches is None, not a pair"), (_g_empty, "return None"), (lambda c: None, "not done yet"),
                (lambda c: [1, 2], "(keys, values) pair"), (_g_none_if_any_uncached, "one sequence has nothing cached")]
WRONG_SCATTER = [(_s_from_start, "cached part"), (_s_off_by_one, "cached part"), (_s_overwrite, "lost its history"),
                 (_s_split_by_cached, "another sequence's new keys"), (_s_all_new, "another sequence's new keys"),
                 (_s_swapped, "swapped"), (lambda *a: None, "not done yet"), (lambda *a: [], "one (keys, values)"),
                 (_LateBug(), "inside the engine"), (_s_values_from_keys, "values came from the packed keys"),
                 (_s_values_misplaced, "values are not placed like them")]


@pytest.mark.parametrize("wrong, words", WRONG_GATHER, ids=[w for _, w in WRONG_GATHER])
def test_wrong_gathers_fail_with_their_hint(bierce_model, capsys, wrong, words):
    model, tok = bierce_model
    assert not check_gather_scatter(wrong, scatter, model, tok)
    out = capsys.readouterr().out
    assert out.startswith("✗") and words in out, out


@pytest.mark.parametrize("wrong, words", WRONG_SCATTER, ids=[w for _, w in WRONG_SCATTER])
def test_wrong_scatters_fail_with_their_hint(bierce_model, capsys, wrong, words):
    model, tok = bierce_model
    assert not check_gather_scatter(gather, wrong, model, tok)
    out = capsys.readouterr().out
    assert out.startswith("✗") and words in out, out


def test_not_functions_get_a_hint(bierce_model, capsys):
    model, tok = bierce_model
    assert not check_gather_scatter(gather([None]), scatter, model, tok)
    assert "pass your function itself" in capsys.readouterr().out
    assert not check_gather_scatter(gather, lambda *a: 1 / 0, model, tok)
    assert "ZeroDivisionError" in capsys.readouterr().out


def test_the_engine_is_left_as_it_was(bierce_model):
    """The check patches only its own engine: a fresh engine afterwards still uses the real cache."""
    model, tok = bierce_model
    check_gather_scatter(gather, _s_overwrite, model, tok)
    from cbteach import Engine, Request
    out = Engine(model, tok, max_batch_size=2).run([Request("CYNIC, n.", 6, ignore_eos=True)])
    x = tok("CYNIC, n.", return_tensors="pt")
    ref = model.generate(**x, do_sample=False, max_new_tokens=6, min_new_tokens=6)[0, x["input_ids"].shape[1]:]
    assert out[0].output_ids == ref.tolist()


@pytest.mark.parametrize("check", [check_position_ids, check_mask])
def test_a_stub_left_undone_says_not_done_yet(check, capsys):
    assert not check(CACHED, NEW, ...)  # what the student copy's stub assigns
    assert "not done yet" in capsys.readouterr().out
