"""Plug points: a learner's pieces in the real engine (notebooks 05, 06 and 12), and the rules they are
held to. With correct pieces the tokens equal ``generate``'s; a piece that breaks a rule stops the
engine with :class:`~cbteach.errors.EngineRuleError` naming it -- never wrong tokens."""
from __future__ import annotations

import dataclasses

import math

import pytest
import torch

from cbteach import Engine, Request
from cbteach.attention.reference import reference_attention
from cbteach.engine.scheduler import Scheduler
from cbteach.errors import EngineRuleError
from conftest import ARCHS, reference, tiny_model

REQS = [([7, 8, 9, 10, 11], 9), ([12, 13], 7), (list(range(20, 37)), 5), ([40], 6)]


class FreeListManager:
    """A learner's KV manager: a free list and the two calls."""

    def __init__(self, num_blocks, block_size):
        self.free_blocks = list(range(num_blocks))
        self.block_size = block_size

    def allocate_slots(self, seq, num_new_tokens):
        need = math.ceil((seq.num_computed_tokens + num_new_tokens) / self.block_size) - len(seq.block_table)
        if need > len(self.free_blocks):
            return None
        new = [self.free_blocks.pop(0) for _ in range(max(need, 0))]
        seq.block_table.extend(new)
        return new

    def free(self, seq):
        self.free_blocks.extend(seq.block_table)
        seq.block_table.clear()


class LeakyManager(FreeListManager):
    def free(self, seq):
        seq.block_table.clear()  # forgets to give the blocks back


def my_slot_mapping(block_tables, num_computed_tokens, num_scheduled_tokens, block_size):
    return [table[p // block_size] * block_size + p % block_size
            for table, c, n in zip(block_tables, num_computed_tokens, num_scheduled_tokens) for p in range(c, c + n)]


def my_attention(query, key, value, meta, layer, scaling):
    meta.pool.write(layer, meta.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))
    return reference_attention(query, layer, meta, scaling)


def run(model, **pieces):
    eng = Engine(model, max_batch_size=3, kv="paged", block_size=4, num_blocks=9, **pieces)
    got = eng.run([Request(p, n, request_id=i, ignore_eos=True) for i, (p, n) in enumerate(REQS)])
    return eng, [c.output_ids for c in got]


@pytest.mark.parametrize("arch", ARCHS)
def test_a_learners_manager_slot_mapping_and_attention_give_generates_tokens(arch):
    model = tiny_model(arch)
    eng, got = run(model, kv_manager=FreeListManager, slot_mapping=my_slot_mapping, attention=my_attention)
    assert got == [reference(model, p, n, eos_id=-1) for p, n in REQS]
    assert any(r.preempted for r in eng.records), "the pool is small enough to preempt"
    assert len(eng.kv.manager.mine.free_blocks) == 9


def test_a_slot_mapping_that_swaps_block_and_offset_stops_the_engine():
    def swapped(block_tables, num_computed_tokens, num_scheduled_tokens, block_size):
        return [(p % block_size) * block_size + table[p // block_size]
                for table, c, n in zip(block_tables, num_computed_tokens, num_scheduled_tokens) for p in range(c, c + n)]

    with pytest.raises(EngineRuleError, match="slot_mapping put token"):
        run(tiny_model("llama"), slot_mapping=swapped)


def test_an_attention_function_with_the_wrong_shape_stops_the_engine():
    def flat(query, key, value, meta, layer, scaling):
        return query[0]

    with pytest.raises(EngineRuleError, match="shaped like the queries"):
        run(tiny_model("gpt2"), attention=flat)


def test_a_manager_that_leaks_stops_the_engine():
    with pytest.raises(EngineRuleError, match="not back in the free list"):
        run(tiny_model("gpt2"), kv_manager=LeakyManager)


class ForgetsToCount(Scheduler):
    def update_after_schedule(self, out):  # the learner's schedule() never moves num_computed_tokens
        pass


class OverBudget(Scheduler):
    def schedule(self, now):
        out = super().schedule(now)
        more = {rid: n + 1 for rid, n in out.num_scheduled_tokens.items()}
        return dataclasses.replace(out, num_scheduled_tokens=more, total_num_scheduled_tokens=sum(more.values()))


@pytest.mark.parametrize("cls,message", [(ForgetsToCount, "update_after_schedule"), (OverBudget, "token budget|only")])
def test_a_scheduler_that_breaks_a_rule_stops_the_engine(cls, message):
    eng = Engine(tiny_model("llama"), max_batch_size=3, kv="paged", block_size=4, token_budget=8, scheduler_cls=cls)
    with pytest.raises(EngineRuleError, match=message):
        eng.run([Request([7, 8, 9], 4), Request([10, 11], 4)])


def test_plug_points_need_the_paged_cache_and_functions():
    model = tiny_model("gpt2")
    with pytest.raises(ValueError, match="kv='paged'"):
        Engine(model, max_batch_size=2, kv_manager=FreeListManager)
    with pytest.raises(ValueError, match="attention must be a function"):
        Engine(model, max_batch_size=2, kv="paged", attention="flash")
    with pytest.raises(ValueError, match="needs a method allocate_slots"):
        Engine(model, max_batch_size=2, kv="paged", kv_manager=object())
    for kv in ("paged", "concat"):  # (it built, then every step raised TypeError)
        with pytest.raises(ValueError, match=r"update_batch must be a function update_batch\(runner, scheduler_output\), "
                                             "got int"):
            Engine(model, max_batch_size=2, kv=kv, update_batch=5)
        with pytest.raises(ValueError, match="'<lambda>' cannot take those two arguments"):
            Engine(model, max_batch_size=2, kv=kv, update_batch=lambda: None)
    assert Engine(model, max_batch_size=2, kv="paged", update_batch=lambda runner, msg, *more: None) is not None

    class NoFreeList(FreeListManager):
        def __init__(self, num_blocks, block_size):
            self.block_size = block_size

    with pytest.raises(ValueError, match="free_blocks"):
        Engine(model, max_batch_size=2, kv="paged", kv_manager=NoFreeList)


def test_the_engines_own_pieces_plugged_in_are_the_engine():
    model = tiny_model("qwen2")
    _, mine = run(model, attention=my_attention, slot_mapping=my_slot_mapping)
    _, own = run(model)
    assert mine == own
    assert torch.equal(torch.tensor(mine[0]), torch.tensor(reference(model, REQS[0][0], REQS[0][1], eos_id=-1)))
