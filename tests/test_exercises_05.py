"""Notebook 05's self-check runs the real engine on the learner's KV manager and names what is wrong."""
import math

import pytest

from cbteach.exercises import ex05
from conftest import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


class Right:
    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks))

    def need(self, seq, n):
        return math.ceil((seq.num_computed_tokens + n) / self.block_size) - len(seq.block_table)

    def allocate_slots(self, seq, num_new_tokens):
        need = self.need(seq, num_new_tokens)
        if need > len(self.free_blocks):
            return None
        new = [self.free_blocks.pop() for _ in range(need)]
        seq.block_table.extend(new)
        return new

    def free(self, seq):
        self.free_blocks.extend(seq.block_table)
        seq.block_table = []


class OldestFirst(Right):  # another right answer: hand out the oldest free block first
    def allocate_slots(self, seq, n):
        need = self.need(seq, n)
        if need > len(self.free_blocks):
            return None
        new = [self.free_blocks.pop(0) for _ in range(need)]
        seq.block_table.extend(new)
        return new


class OneTooMany(Right):
    def need(self, seq, n):
        return math.ceil((seq.num_computed_tokens + n + 1) / self.block_size) - len(seq.block_table)


class Floor(Right):
    def need(self, seq, n):
        return max(0, (seq.num_computed_tokens + n) // self.block_size - len(seq.block_table))


class TotalNotNew(Right):  # compares the whole table's blocks with the free list
    def allocate_slots(self, seq, n):
        if math.ceil((seq.num_computed_tokens + n) / self.block_size) > len(self.free_blocks):
            return None
        return super().allocate_slots(seq, n)


class KeepsTable(Right):
    def free(self, seq):
        self.free_blocks.extend(seq.block_table)


class Leaks(Right):
    def free(self, seq):
        seq.block_table = []


class LeavesFree(Right):
    def allocate_slots(self, seq, n):
        new = self.free_blocks[:self.need(seq, n)]
        seq.block_table.extend(new)
        return new


class Prepends(Right):
    def allocate_slots(self, seq, n):
        new = [self.free_blocks.pop() for _ in range(self.need(seq, n))]
        seq.block_table[:0] = new
        return new


class Raises(Right):
    def free(self, seq):
        raise KeyError("oops")


class MissingBlock(Right):
    def __init__(self, num_blocks, block_size):
        super().__init__(num_blocks, block_size)
        self.free_blocks.pop(0)


@pytest.mark.parametrize("answer", [Right, OldestFirst])
def test_ex05_accepts_right_managers(model, capsys, answer):
    assert ex05.check_kv_manager(answer, model)
    out = capsys.readouterr().out
    assert out.startswith("✓") and "preemptions" in out


@pytest.mark.parametrize("wrong, words", [
    (OneTooMany, "only when the last one is full"),
    (Floor, "too few for its tokens"),
    (TotalNotNew, "*new* blocks"),
    (KeepsTable, "seq.block_table is not empty"),
    (Leaks, "not back in the free list"),
    (LeavesFree, "left it in the free list"),
    (Prepends, "append them at the end"),
    (Raises, "raised KeyError"),
    (MissingBlock, "every block 0 .. num_blocks - 1 free"),
])
def test_ex05_names_what_is_wrong(model, capsys, wrong, words):
    assert not ex05.check_kv_manager(wrong, model)
    out = capsys.readouterr().out
    assert out.startswith("✗") and words in out


def test_ex05_wants_the_class(model, capsys):
    assert not ex05.check_kv_manager(Right(4, 4), model)
    assert "pass your class itself" in capsys.readouterr().out


def test_ex05_cases_exercise_reuse_and_preemption(model):
    runs = [ex05.serve(model, case) for case in ex05.CASES]
    assert any(r["preemptions"] for r in runs), "one case must make the engine preempt"
    assert any(max(max(b.values(), default=0) for b in r["blocks"]) >= 3 for r in runs)


class NoneTable(Right):  # free() leaves None where the block table was
    def free(self, seq):
        self.free_blocks.extend(seq.block_table)
        seq.block_table = None


class NoneFree(Right):  # a free list the check cannot sort
    def __init__(self, num_blocks, block_size):
        super().__init__(num_blocks, block_size)
        self.free_blocks = [None] * num_blocks


class Offset(Right):  # block ids past the pool: the engine would write outside it
    def __init__(self, num_blocks, block_size):
        super().__init__(num_blocks, block_size)
        self.free_blocks = [b + 100 for b in self.free_blocks]


class RaisingFree(Right):
    free_blocks = property(lambda self: 1 / 0, lambda self, v: None)


@pytest.mark.parametrize("broken", [NoneTable, NoneFree, Offset, RaisingFree])
def test_ex05_broken_managers_get_a_hint_not_a_traceback(model, capsys, broken):
    assert not ex05.check_kv_manager(broken, model)
    assert capsys.readouterr().out.startswith("✗")


# -- vLLM V1's contract: the scheduler asks allocate_slots for each chunk, and its refusal triggers preemption ------

class NeverRefuses(Right):  # hands out what it has, even when that is not enough
    def allocate_slots(self, seq, num_new_tokens):
        new = [self.free_blocks.pop() for _ in range(min(self.need(seq, num_new_tokens), len(self.free_blocks)))]
        seq.block_table.extend(new)
        return new


class TakesThenRefuses(Right):  # takes what is free, then says no: the blocks are lost to everyone
    def allocate_slots(self, seq, num_new_tokens):
        need = self.need(seq, num_new_tokens)
        if need > len(self.free_blocks):
            seq.block_table.extend(self.free_blocks.pop() for _ in range(len(self.free_blocks)))
            return None
        return super().allocate_slots(seq, num_new_tokens)


def test_ex05_a_case_makes_the_manager_refuse(model):
    class Counting(Right):
        refusals = 0

        def allocate_slots(self, seq, num_new_tokens):
            new = super().allocate_slots(seq, num_new_tokens)
            Counting.refusals += new is None
            return new
    assert ex05.check_kv_manager(Counting, model)
    assert Counting.refusals > 0, "no case made the scheduler ask for room the manager had to refuse"


@pytest.mark.parametrize("wrong, words", [(NeverRefuses, "too few for its tokens"),
                                          (TakesThenRefuses, "returned None but changed")])
def test_ex05_fails_managers_that_refuse_wrongly(model, capsys, wrong, words):
    assert not ex05.check_kv_manager(wrong, model)
    out = capsys.readouterr().out
    assert out.startswith("✗") and words in out
