"""The accidental routes by which a learner's piece is the course's own, each refused with the course's piece named
(:mod:`cbteach.exercises.guard`); a piece of the learner's own -- even one that calls the engine's other
helpers -- is not refused. And no module of the package hooks the interpreter."""
from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from cbteach.attention import paged
from cbteach.attention.paged import default_attention
from cbteach.engine.scheduler import Scheduler
from cbteach.exercises import ex05_mistakes, guard
from cbteach.kv.manager import KVCacheManager
from cbteach.parallel.shard import Layout
from cbteach.sim.cost import ring_all_reduce_bytes
from cbteach.worker import model_runner


def calls_the_engines(q, k, v, meta, layer, scaling):
    return paged.default_attention(q, k, v, meta, layer, scaling)


@functools.wraps(default_attention)
def wraps_the_engines(*args):
    return default_attention(*args)


class SuperSchedule(Scheduler):
    def schedule(self, now):
        return super().schedule(now)


class InheritsSchedule(Scheduler):
    def helper(self):
        return 1


class CallsSchedulingHelper(Scheduler):
    def schedule(self, now):
        return self.schedule_running(now)


class KeepsTheEnginesManager:
    def __init__(self, num_blocks, block_size):
        from cbteach.kv.manager import KVCacheManager as Engines

        self.inner, self.free_blocks = Engines(num_blocks, block_size), list(range(num_blocks))

    def allocate_slots(self, seq, n):
        return self.inner.allocate_slots(seq, n)

    def free(self, seq):
        self.inner.free(seq)


class SuperFree(KVCacheManager):
    def allocate_slots(self, seq, n):
        return None

    def free(self, seq):
        super().free(seq)


def update_calls_the_workers(runner, scheduler_output):
    model_runner.update_batch(runner, scheduler_output)


def imports_the_module_inside(q, k, v, meta, layer, scaling):
    import cbteach.attention.paged as P  # (a plain import inside the function: passed the guard once)

    return P.default_attention(q, k, v, meta, layer, scaling)


def imports_the_package_inside(runner, scheduler_output):
    import cbteach.worker.model_runner

    cbteach.worker.model_runner.update_batch(runner, scheduler_output)


def kv_heads_from_the_layout(rank, world_size, heads, kv_heads):
    return Layout(heads, kv_heads, world_size).kv_heads(rank)


ROUTES = [
    ("attention", default_attention, "is the engine's default_attention"),
    ("attention", functools.partial(default_attention), "is the engine's default_attention"),
    ("attention", wraps_the_engines, "is the engine's default_attention"),
    ("attention", calls_the_engines, "calls the engine's default_attention"),
    ("attention", lambda *a: ex05_mistakes.attend(*a), "calls the course's own answer attend"),
    ("slot_mapping", ex05_mistakes.slots, "is the course's own answer slots"),
    ("scheduler", SuperSchedule, "calls the engine's Scheduler.schedule (through super().schedule)"),
    ("scheduler", InheritsSchedule, "not done yet: InheritsSchedule.schedule is still the engine's Scheduler.schedule"),
    ("scheduler", CallsSchedulingHelper, "calls the engine's Scheduler.schedule_running"),
    ("kv_manager", KeepsTheEnginesManager, "__init__ calls the engine's KVCacheManager"),
    ("kv_manager", SuperFree, "calls the engine's KVCacheManager.free (through super().free)"),
    ("kv_manager", KVCacheManager, "not done yet: KVCacheManager.allocate_slots is still the engine's"),
    ("update_batch", update_calls_the_workers, "calls the worker's own update_batch"),
    ("attention", imports_the_module_inside, "calls the engine's default_attention"),
    ("update_batch", imports_the_package_inside, "calls the worker's own update_batch"),
    ("tp", ring_all_reduce_bytes, "is the simulator's ring_all_reduce_bytes"),
    ("tp", kv_heads_from_the_layout, "calls the engine's Layout"),
]


@pytest.mark.parametrize("piece, obj, words", ROUTES, ids=[w for _, _, w in ROUTES])
def test_each_accidental_route_is_refused_naming_the_courses_piece(piece, obj, words):
    said = guard.refusal(piece, obj)
    assert said is not None and words in said, said


class OwnScheduler(Scheduler):
    def schedule(self, now):
        return self.make_output(self.plan_nothing())

    def plan_nothing(self):
        return super().schedule_waiting  # another method of the engine's, named but not this piece's call


class OwnManager(KVCacheManager):
    def allocate_slots(self, seq, n):
        return [self.free_blocks.pop() for _ in range(n)]

    def free(self, seq):
        self.free_blocks += seq.block_table


def own_attention(q, k, v, meta, layer, scaling):
    meta.pool.write(layer, meta.slot_mapping, k[0].transpose(0, 1), v[0].transpose(0, 1))
    return q


@pytest.mark.parametrize("piece, obj", [("scheduler", OwnScheduler), ("attention", own_attention),
                                        ("kv_manager", OwnManager)])
def test_a_piece_of_the_learners_own_is_not_refused(piece, obj):
    assert guard.refusal(piece, obj) is None


def test_no_module_of_the_package_hooks_the_interpreter():
    hooks = re.compile(r"setprofile|settrace|_current_frames|addaudithook|__code__ *=|torch\.library")
    package = Path(guard.__file__).resolve().parents[1]
    assert [str(p) for p in package.rglob("*.py") if hooks.search(p.read_text(encoding="utf-8"))] == []


def test_the_guard_says_it_does_not_police_copying_and_refuses_an_unknown_piece():
    assert "not policed" in guard.__doc__
    with pytest.raises(ValueError, match="piece must be one of"):
        guard.refusal("attnetion", default_attention)
