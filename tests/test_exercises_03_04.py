"""Self-checks of notebooks 03 and 04: right answers pass, wrong ones fail and say what is wrong."""
import pytest
import torch
from conftest import tiny_model

from cbteach import Request
from cbteach.exercises.ex03 import check_mask, check_position_ids, key_labels
from cbteach.exercises.ex04 import check_total_bytes_copied, measure_total_bytes_copied
from cbteach.core.modelinfo import describe
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


def test_wrong_positions_are_named(capsys):
    assert not check_position_ids(CACHED, NEW, [0, 1, 2, 3, 4])
    out = capsys.readouterr().out
    assert "✗" in out and "one long sequence" in out
    assert "row index 0" in out and "you wrote 0, which is too low" in out
    assert "should be" not in out  # a hint, never the answer
    assert not check_position_ids(CACHED, NEW, [0, 0, 1, 2, 0])
    assert "num_computed_tokens" in capsys.readouterr().out
    assert not check_position_ids(CACHED, NEW, [2, 0, 1])
    assert "needs 5 position ids" in capsys.readouterr().out
    assert not check_position_ids(CACHED, NEW, "2 0 1 2 3")
    assert "list of 5 integers" in capsys.readouterr().out


def test_wrong_mask_entries_are_named(capsys):
    mask = block_diagonal_causal_mask(CACHED, NEW).clone()
    mask[1, 0] = True  # B p0 may not see A's cached p0
    assert not check_mask(CACHED, NEW, mask)
    out = capsys.readouterr().out
    assert "1 of 50 entries are wrong" in out
    assert "query B p0 x key A p0 (cached): you allowed it, but it must be blocked" in out


def test_mask_hints(capsys):
    q, k = sum(NEW), sum(CACHED) + sum(NEW)
    assert not check_mask(CACHED, NEW, torch.ones(q, k, dtype=torch.bool).tril(k - q))
    assert "plain causal" in capsys.readouterr().out
    assert not check_mask(CACHED, NEW, per_sequence_causal_mask(CACHED, NEW))
    assert "per-sequence layout" in capsys.readouterr().out
    assert not check_mask(CACHED, NEW, torch.ones(q, sum(NEW), dtype=torch.bool).tril())
    assert "include the 5 cached" in capsys.readouterr().out
    assert not check_mask(CACHED, NEW, block_diagonal_causal_mask(CACHED, NEW).float())
    assert "boolean mask" in capsys.readouterr().out


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
def formula_total(model, requests):
    """The notebook's solution: per request, a prefill step then one decode step per further token."""
    per_token = describe(model).kv_bytes_per_token
    total = 0
    for r in requests:
        p = len(r.prompt)
        total += per_token * 2 * p  # prefill: nothing cached; the model's update and our scatter copy p
        for k in range(1, r.max_new_tokens):
            total += per_token * (4 * (p + k - 1) + 2)
    return total


def _requests(ignore_eos=True):
    return [Request([7, 8, 9, 10], 5, request_id="a", ignore_eos=ignore_eos),
            Request([11, 12], 3, request_id="b", ignore_eos=ignore_eos),
            Request([13] * 6, 4, request_id="c", ignore_eos=ignore_eos)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("max_batch_size", [1, 2, 3])
def test_formula_matches_the_engine(arch, max_batch_size):
    model = tiny_model(arch)
    measured, records = measure_total_bytes_copied(model, None, _requests(), max_batch_size)
    assert measured == formula_total(model, _requests())  # the total does not depend on the batching
    per_token = describe(model).kv_bytes_per_token
    for r in records:  # and per step: gather C, DynamicCache C, model's update C + N, scatter C + N
        assert r.kv_bytes_copied == per_token * (4 * sum(r.num_computed_tokens) + 2 * sum(r.num_scheduled_tokens))


def test_total_bytes_check(capsys):
    model = tiny_model("llama")
    right = formula_total(model, _requests())
    assert check_total_bytes_copied(model, None, _requests(), 2, right)
    assert "exactly what the engine measured" in capsys.readouterr().out
    info = describe(model)
    _, records = measure_total_bytes_copied(model, None, _requests(), 2)
    cached = sum(sum(r.num_computed_tokens) for r in records)
    assert not check_total_bytes_copied(model, None, _requests(), 2, info.kv_bytes_per_token * cached)
    assert "gather alone" in capsys.readouterr().out
    new = sum(sum(r.num_scheduled_tokens) for r in records)
    assert not check_total_bytes_copied(model, None, _requests(), 2, info.kv_bytes_per_token * (2 * cached + new))
    assert "DynamicCache" in capsys.readouterr().out
    assert not check_total_bytes_copied(model, None, _requests(), 2, right // info.num_layers)
    assert "one layer" in capsys.readouterr().out
    assert not check_total_bytes_copied(model, None, _requests(), 2, right // 4)
    assert "elements" in capsys.readouterr().out
    assert not check_total_bytes_copied(model, None, _requests(), 2, "lots")
    assert "number of bytes" in capsys.readouterr().out
    assert not check_total_bytes_copied(model, None, _requests(ignore_eos=False), 2, right)
    assert "ignore_eos=True" in capsys.readouterr().out


@pytest.mark.parametrize("answer", [None, {1: 2}, lambda: 0, [[None] * 10] * 5, []])
def test_masks_of_the_wrong_kind_get_a_hint_not_a_traceback(answer, capsys):
    assert not check_mask(CACHED, NEW, answer)
    assert capsys.readouterr().out.startswith("✗")
