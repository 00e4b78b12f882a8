"""The contiguous-reservation allocator, plugged into the real engine, and the memory measurements."""
from types import SimpleNamespace

import matplotlib
import pytest

from cbteach import Engine, Request
from cbteach.bench import memory_experiments as mx
from cbteach.core.modelinfo import describe
from conftest import tiny_model

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def seq(rid, prompt, max_new):
    return SimpleNamespace(request_id=rid, prompt_ids=[1] * prompt, request=SimpleNamespace(max_new_tokens=max_new),
                           block_table=[], num_computed_tokens=0)


def test_first_fit_reserves_one_contiguous_region():
    m = mx.ReservingKVManager(20)
    a, b, c = seq("a", 2, 4), seq("b", 3, 5), seq("c", 1, 5)
    assert m.allocate_slots(a, 2) == list(range(0, 6))
    assert m.allocate_slots(b, 3) == list(range(6, 14))
    assert m.allocate_slots(a, 1) == []  # room was reserved at admission
    m.free(a)
    assert m.holes() == [(0, 6), (14, 6)]
    assert m.num_admittable_tokens(c) == 6 and m.allocate_slots(c, 1) == list(range(0, 6))  # first fit: lowest hole
    big = seq("d", 4, 4)
    assert m.num_admittable_tokens(big) == 0 and m.allocate_slots(big, 4) is None and big.block_table == []
    assert mx.hole_lengths([b.block_table, c.block_table], 20) == [6]


def test_plug_refuses_what_it_cannot_serve(model):
    with pytest.raises(ValueError, match="kv='paged'"):
        mx.plug(Engine(model, None, max_batch_size=2), mx.ReservingKVManager(8))
    with pytest.raises(ValueError, match="blocks of"):
        mx.plug(Engine(model, None, max_batch_size=2, kv="paged", block_size=4, num_blocks=8),
                mx.ReservingKVManager(8))


def requests():
    # Slots reserved: 10, 10, 10, then 15. The first and third finish after 4 steps; the second holds the middle.
    shape = [(6, 4), (2, 8), (6, 4), (5, 10)]
    return [Request([1 + i] * p, n, request_id=f"r{i}", ignore_eos=True) for i, (p, n) in enumerate(shape)]


def test_reservation_runs_in_the_engine_and_waits_for_a_hole(model):
    per_token = describe(model).kv_bytes_per_token
    reserve = mx.run_with_budget(model, None, requests(), "reserve", 30 * per_token)
    paged = mx.run_with_budget(model, None, requests(), "paged", 32 * per_token, block_size=4)
    assert reserve["outputs"] == paged["outputs"] and reserve["preemptions"] == 0
    assert reserve["engine"].kv.num_blocks == 30 and reserve["peak_running"] == 3
    assert reserve["steps"] > paged["steps"] and paged["mean_running"] > reserve["mean_running"]
    waits = mx.waiting_for_a_hole(reserve["engine"])
    assert [w["step"] for w in waits] == [4, 5, 6, 7]
    assert all(w["request"] == "r3" and w["need"] == 15 and w["free"] == 20 and w["largest"] == 10 for w in waits)


def test_block_size_stats_and_the_memory_map(model):
    from cbteach.viz.pool import draw_memory_map, memory_map

    for bs, waste in ((1, 0.0), (8, None)):
        eng = Engine(model, None, max_batch_size=4, kv="paged", block_size=bs, num_blocks=64)
        eng.run(requests())
        stats = mx.block_size_stats(eng)
        assert stats["block_size"] == bs and stats["table_entries_per_seq"] > 0
        assert stats["wasted_slots_per_seq"] == waste if waste is not None else 0 < stats["wasted_slots_per_seq"] < bs
    img = memory_map(eng.records)
    assert img.shape == (64 * 8, len(eng.records), 3)
    ax = draw_memory_map(eng.records, marks=[1, 2], title="map")
    assert ax.get_title() == "map" and ax.get_xlabel() == "engine step"
