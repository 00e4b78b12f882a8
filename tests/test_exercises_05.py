"""Notebook 05's self-check runs the real engine on the learner's KV manager and names what is wrong."""
import dataclasses
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


class WholeSequence(Right):  # room for every token of the sequence, not for this step's chunk
    def allocate_slots(self, seq, n):
        return super().allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens)


class PerCall(Right):  # blocks for this call's tokens alone, unless the table already has room for them
    def need(self, seq, n):
        covered = len(seq.block_table) * self.block_size >= seq.num_computed_tokens + n
        return 0 if covered else math.ceil(n / self.block_size)


class RefusesWithFalse(Right):
    def allocate_slots(self, seq, n):
        return False if self.need(seq, n) > len(self.free_blocks) else super().allocate_slots(seq, n)


class MovesComputed(Right):  # counts the new tokens as computed itself: the scheduler's job
    def allocate_slots(self, seq, n):
        new = super().allocate_slots(seq, n)
        if new is not None:
            seq.num_computed_tokens += n
        return new


class MissingBlock(Right):
    def __init__(self, num_blocks, block_size):
        super().__init__(num_blocks, block_size)
        self.free_blocks.pop(0)


@pytest.mark.parametrize("answer", [Right, OldestFirst])
def test_ex05_accepts_right_managers(model, capsys, answer):
    assert ex05.check_kv_manager(answer, model)
    out = capsys.readouterr().out
    assert out.startswith("✓") and "preemptions" in out


class Stub:  # what the student copy hands out: every method's body is "..."
    def __init__(self, num_blocks, block_size):
        ...

    def allocate_slots(self, seq, num_new_tokens):
        ...

    def free(self, seq):
        ...


class NoFreeList(Right):  # forgot to make the free list
    def __init__(self, num_blocks, block_size):
        self.block_size = block_size


@pytest.mark.parametrize("wrong, words", [
    (Stub, "not done yet"),
    (NoFreeList, "should keep self.free_blocks"),
    (OneTooMany, "only when the last one is full"),
    (Floor, "too few for its tokens"),
    (TotalNotNew, "*new* blocks"),
    (KeepsTable, "seq.block_table is not empty"),
    (Leaks, "not back in the free list"),
    (LeavesFree, "left it in the free list"),
    (Prepends, "append them at the end"),
    (Raises, "raised KeyError"),
    (MissingBlock, "every block 0 .. num_blocks - 1 free"),
    (WholeSequence, "make room for num_computed_tokens + num_new_tokens"),  # (passed while no prefill was chunked)
    (PerCall, "make room for num_computed_tokens + num_new_tokens"),  # (passed while every chunk began a block)
    (RefusesWithFalse, "returned False: to refuse, return None"),
    (MovesComputed, "changed seq.num_computed_tokens"),  # (was told "too few for its tokens", which was false)
])
def test_ex05_names_what_is_wrong(model, capsys, wrong, words):
    assert not ex05.check_kv_manager(wrong, model)
    out = capsys.readouterr().out
    assert out.startswith("✗") and words in out
    if wrong is Floor:  # short of blocks with plenty free: the hint must not send it to refusing
        assert "refuse (return None)" not in out, out


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


@pytest.mark.parametrize("broken, words", [(NoneTable, "leave it an empty list"),
                                           (NoneFree, "block ids are the ints 0 .. num_blocks - 1"),
                                           (Offset, "every block 0 .. num_blocks - 1 free"),
                                           (RaisingFree, "the check stopped with ZeroDivisionError")])
def test_ex05_broken_managers_get_a_hint_not_a_traceback(model, capsys, broken, words):
    assert not ex05.check_kv_manager(broken, model)
    out = capsys.readouterr().out
    assert out.startswith("✗") and words in out and "Traceback" not in out, out


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


@pytest.mark.parametrize("wrong, words", [(NeverRefuses, "then refuse (return None) and change nothing"),
                                          (TakesThenRefuses, "returned None but changed")])
def test_ex05_fails_managers_that_refuse_wrongly(model, capsys, wrong, words):
    assert not ex05.check_kv_manager(wrong, model)
    out = capsys.readouterr().out
    assert out.startswith("✗") and words in out


# == Exercise 2: the slot mapping and paged attention ==================================================
# Wrong answers are written as a learner would write them, not taken from the check's own list of mistakes.

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from cbteach.attention.metadata import build  # noqa: E402
from cbteach.attention.paged import default_attention  # noqa: E402
from cbteach.attention.reference import reference_attention  # noqa: E402
from cbteach.exercises import ex05_attention, ex05_mistakes  # noqa: E402


def slot_mapping(block_tables, num_computed_tokens, num_scheduled_tokens, block_size):
    out = []
    for table, c, n in zip(block_tables, num_computed_tokens, num_scheduled_tokens):
        out += [table[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
    return out


def attention(query, key, value, meta, layer, scaling, *, order="write_first", diagonal=0, heads="interleave",
              context="exact", slot="right", mask_decodes=True, scale=True, write_layer=None, softmax=None, row=None,
              read_layer=None, mask_dtype=torch.bool, invert_mask=False, scale_queries=False, heads_of=None):
    """The notebook's solution, with one mistake switched on by a keyword."""
    def write():
        meta.pool.write(layer if write_layer is None else write_layer, meta.slot_mapping,
                        key[0].transpose(0, 1), value[0].transpose(0, 1))
    if order == "write_first":
        write()
    out, bs = torch.empty_like(query), meta.block_size
    group = (query.shape[1] if heads_of is None else heads_of) // key.shape[1]
    for i, (c, n) in enumerate(zip(meta.num_computed_tokens, meta.num_scheduled_tokens)):
        start = int(meta.query_start_loc[i])
        length = {"exact": c + n, "floor": (c + n) // bs * bs, "whole_blocks": math.ceil((c + n) / bs) * bs,
                  "padded_row": meta.block_tables.shape[1] * bs}[context]
        pos = torch.arange(length)
        table = meta.block_tables[{None: i, "zero": 0, "layer": layer}[row]]
        slots = {"right": lambda: table[pos // bs] * bs + pos % bs, "swapped": lambda: table[pos % bs] * bs + pos // bs,
                 "no_times": lambda: table[pos // bs] + pos % bs}[slot]()
        k, v = meta.pool.read_slots(layer if read_layer is None else read_layer, slots)
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        if heads == "interleave":
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        elif heads == "tile":
            k, v = k.repeat(group, 1, 1), v.repeat(group, 1, 1)
        mask = torch.ones(n, length, dtype=mask_dtype).tril(diagonal=c + diagonal if diagonal != "zero" else 0)
        if n == 1 and not mask_decodes:
            mask = None
        if invert_mask:  # True read as "hidden"
            mask = ~mask
        q = query[0, :, start:start + n] * (scaling if scale_queries else 1)
        if softmax is not None:  # written by hand: scores, the mask as -inf, a softmax along one axis
            scores = (query[0, :, start:start + n] @ k.transpose(-1, -2)) * scaling
            scores = scores.masked_fill(~mask, float("-inf"))
            out[0, :, start:start + n] = scores.softmax(dim={"keys": -1, "queries": -2}[softmax]) @ v
            continue
        out[0, :, start:start + n] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                    scale=scaling if scale else None)
    if order == "write_after":
        write()
    return out


def wrong_attention(**mistake):
    return lambda q, k, v, meta, layer, scaling: attention(q, k, v, meta, layer, scaling, **mistake)


def concat_new(query, key, value, meta, layer, scaling):
    """Never writes the pool: reads the history and appends this step's keys itself."""
    out, bs, group = torch.empty_like(query), meta.block_size, query.shape[1] // key.shape[1]
    for i, (c, n) in enumerate(zip(meta.num_computed_tokens, meta.num_scheduled_tokens)):
        s = int(meta.query_start_loc[i])
        pos = torch.arange(c)
        k, v = meta.pool.read_slots(layer, meta.block_tables[i, pos // bs] * bs + pos % bs)
        k = torch.cat([k, key[0, :, s:s + n].transpose(0, 1)]).transpose(0, 1).repeat_interleave(group, 0)
        v = torch.cat([v, value[0, :, s:s + n].transpose(0, 1)]).transpose(0, 1).repeat_interleave(group, 0)
        mask = torch.ones(n, c + n, dtype=torch.bool).tril(diagonal=c)
        out[0, :, s:s + n] = F.scaled_dot_product_attention(query[0, :, s:s + n], k, v, attn_mask=mask, scale=scaling)
    return out


def sdpa_is_causal(query, key, value, meta, layer, scaling):
    """The commonest real-world slip: SDPA's own causal flag over the whole context (it aligns top-left)."""
    meta.pool.write(layer, meta.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))
    out, bs, group = torch.empty_like(query), meta.block_size, query.shape[1] // key.shape[1]
    for i, (c, n) in enumerate(zip(meta.num_computed_tokens, meta.num_scheduled_tokens)):
        s = int(meta.query_start_loc[i])
        pos = torch.arange(c + n)
        k, v = meta.pool.read_slots(layer, meta.block_tables[i, pos // bs] * bs + pos % bs)
        k, v = k.transpose(0, 1).repeat_interleave(group, 0), v.transpose(0, 1).repeat_interleave(group, 0)
        out[0, :, s:s + n] = F.scaled_dot_product_attention(query[0, :, s:s + n], k, v, is_causal=n > 1, scale=scaling)
    return out


def this_step_only(query, key, value, meta, layer, scaling):
    """Forgets the cache: each sequence attends to the tokens it feeds this step, read back at the slot mapping."""
    meta.pool.write(layer, meta.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))
    out, group = torch.empty_like(query), query.shape[1] // key.shape[1]
    for i, (c, n) in enumerate(zip(meta.num_computed_tokens, meta.num_scheduled_tokens)):
        s = int(meta.query_start_loc[i])
        k, v = meta.pool.read_slots(layer, meta.slot_mapping[s:s + n])
        k, v = k.transpose(0, 1).repeat_interleave(group, 0), v.transpose(0, 1).repeat_interleave(group, 0)
        out[0, :, s:s + n] = F.scaled_dot_product_attention(query[0, :, s:s + n], k, v, is_causal=True, scale=scaling)
    return out


def gqa_not_repeated(query, key, value, meta, layer, scaling):
    return wrong_attention(heads="none")(query, key, value, meta, layer, scaling)


def engine_style(query, key, value, meta, layer, scaling):
    """Another right answer: the engine's own readable version behind its write."""
    meta.pool.write(layer, meta.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))
    return reference_attention(query, layer, meta, scaling)


class RightOnlyOnTheHandBuiltSteps:
    """Right on the check's own steps, wrong from then on: only the real engine can catch it."""

    def __init__(self):
        self.calls = 0

    def __call__(self, q, k, v, meta, layer, scaling):
        self.calls += 1
        late = self.calls > len(ex05_attention.HEADS)
        return attention(q, k, v, meta, layer, scaling, diagonal=1 if late else 0)


def gathers_whole_blocks(query, key, value, meta, layer, scaling):
    """Another right answer: whole blocks gathered at once, the padding masked, enable_gqa for the heads."""
    meta.pool.write(layer, meta.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))
    out = torch.empty_like(query)
    for i, (c, n) in enumerate(zip(meta.num_computed_tokens, meta.num_scheduled_tokens)):
        s = int(meta.query_start_loc[i])
        k, v = meta.pool.read(layer, meta.block_tables[i:i + 1])  # [1, width * bs, kv_heads, D]
        k, v = k[0].transpose(0, 1), v[0].transpose(0, 1)
        keys = torch.arange(k.shape[1])
        mask = keys[None, :] <= (c + torch.arange(n))[:, None]  # causal, and nothing past the sequence's end
        out[0, :, s:s + n] = F.scaled_dot_product_attention(query[0, :, s:s + n], k, v, attn_mask=mask, scale=scaling,
                                                            enable_gqa=True)
    return out


@pytest.mark.parametrize("right", [attention, gathers_whole_blocks, wrong_attention(mask_decodes=False),
                                   wrong_attention(softmax="keys")],
                         ids=["loop", "whole_blocks_masked", "decodes_unmasked", "softmax_by_hand"])
def test_ex05_attention_accepts_right_answers_in_the_real_engine(model, capsys, right):
    assert ex05_attention.check_paged_attention(right, model, slot_mapping=slot_mapping)
    out = capsys.readouterr().out
    assert out.startswith("✓") and "equal to generate's" in out


def test_ex05_slot_mapping_accepts_right_answers(model, capsys):
    assert ex05_attention.check_slot_mapping(slot_mapping, model)
    numpy_ints = lambda *a: __import__("numpy").array(slot_mapping(*a))  # noqa: E731
    assert ex05_attention.check_slot_mapping(numpy_ints, model)
    assert capsys.readouterr().out.count("✓") == 2


def _swapped(tables, computed, scheduled, bs):
    return [t[p % bs] * bs + p // bs for t, c, n in zip(tables, computed, scheduled) for p in range(c, c + n)]


WRONG_SLOTS = [
    (_swapped, "block and offset are swapped"),
    (lambda t, c, s, bs: [x[p // bs] + p % bs for x, cc, n in zip(t, c, s) for p in range(cc, cc + n)],
     "block b starts at slot b * block_size"),
    (lambda t, c, s, bs: [x[p // bs] * bs + p % bs for x, n in zip(t, s) for p in range(n)], "not 0"),
    (lambda t, c, s, bs: [x[p // bs] * bs + p % bs for x, cc, n in zip(t, c, s) for p in range(cc + 1, cc + n + 1)],
     "positions count from 0"),
    (lambda t, c, s, bs: [x[-1] * bs + p % bs for x, cc, n in zip(t, c, s) for p in range(cc, cc + n)],
     "not every new token goes into the sequence's last block"),
    (lambda t, c, s, bs: [[x[p // bs] * bs + p % bs for p in range(cc, cc + n)] for x, cc, n in zip(t, c, s)],
     "one flat list"),
    (lambda t, c, s, bs: [x[(cc + n - 1) // bs] * bs + (cc + n - 1) % bs for x, cc, n in zip(t, c, s)],
     "one slot per token fed this step"),
    (lambda t, c, s, bs: slot_mapping(t[::-1], c[::-1], s[::-1], bs), "wrong order"),
    (lambda t, c, s, bs: None, "not done yet"),
    (lambda t, c, s, bs: [float(x) for x in slot_mapping(t, c, s, bs)], "whole number"),
    (lambda t, c, s, bs: build([1] * sum(s), c, s, "cpu", block_tables=t, block_size=bs).slot_mapping.tolist(),
     "calls the engine's build"),
    # off by one at a block boundary, three ways a learner writes it: each indexes past a table's end
    (lambda t, c, s, bs: [x[math.ceil(p / bs)] * bs + p % bs for x, cc, n in zip(t, c, s) for p in range(cc, cc + n)],
     "off by one at a block boundary"),
    (lambda t, c, s, bs: [x[(p + 1) // bs] * bs + p % bs for x, cc, n in zip(t, c, s) for p in range(cc, cc + n)],
     "off by one at a block boundary"),
    (lambda t, c, s, bs: [x[(p - 1) // bs] * bs + p % bs for x, cc, n in zip(t, c, s) for p in range(cc, cc + n)],
     "off by one at a block boundary"),
    (lambda t, c, s, bs: [x[p // bs + 1] * bs + p % bs for x, cc, n in zip(t, c, s) for p in range(cc, cc + n)],
     "off by one at a block boundary"),
    (lambda t, c, s, bs: [t[0][p // bs] * bs + p % bs for cc, n in zip(c, s) for p in range(cc, cc + n)],
     "through sequence 0's block table"),
    # a table's blocks taken as side by side: named "swapped" before (equal to it on the step of one-token blocks)
    (lambda t, c, s, bs: [x[0] * bs + p for x, cc, n in zip(t, c, s) for p in range(cc, cc + n)],
     "need not lie side by side in the pool"),
    # [1, T], as the model's position ids: passed the hand-built steps, then the engine refused it as "returned Tensor"
    (lambda t, c, s, bs: torch.tensor([slot_mapping(t, c, s, bs)]), "a tensor of shape (1, "),
    # block_size typed in (vLLM's 16, or the notebook's 4): got "not where their block tables put them"
    (lambda t, c, s, bs: slot_mapping(t, c, s, 16), "the argument block_size, not a number of your own"),
    (lambda t, c, s, bs: slot_mapping(t, c, s, 4), "block_size, not a number of your own"),
]


@pytest.mark.parametrize("wrong, hint", WRONG_SLOTS, ids=[h for _, h in WRONG_SLOTS])
def test_ex05_wrong_slot_mappings_fail_with_their_hint(model, capsys, wrong, hint):
    assert not ex05_attention.check_slot_mapping(wrong, model)
    out = capsys.readouterr().out
    assert out.startswith("✗") and hint in out, out
    for _, bs, seqs in ex05_attention.STEPS:  # the right slots are never shown
        right = slot_mapping([t for _, _, t in seqs], [c for c, _, _ in seqs], [n for _, n, _ in seqs], bs)
        assert str(right) not in out and str(right)[1:-1] not in out


WRONG_ATTENTION = [
    (wrong_attention(slot="swapped"), "block and offset are swapped"),
    (wrong_attention(slot="no_times"), "block b starts at slot b * block_size"),
    (wrong_attention(order="write_after"), "write them into the pool first"),
    (wrong_attention(order="never"), "does not hold this step's keys and values"),
    (concat_new, "does not hold this step's keys and values"),
    (wrong_attention(write_layer=0), "another layer's pool"),
    (wrong_attention(diagonal=-1), "do not see their own key"),
    (wrong_attention(diagonal=1), "one key past their own position"),
    (wrong_attention(diagonal="zero"), "a chunk that continues a prompt starts after"),
    (sdpa_is_causal, "is_causal=True lines its mask up top-left"),
    (wrong_attention(heads="tile"), "the query heads that share a KV head are consecutive"),
    (gqa_not_repeated, "grouped-query attention"),
    (wrong_attention(context="whole_blocks", mask_decodes=False), "stale K/V"),
    (wrong_attention(context="padded_row", mask_decodes=False), "stale K/V"),
    (wrong_attention(context="floor"), "only partly filled"),
    (wrong_attention(scale=False), "use the scaling the layer passes you"),
    (lambda *a: None, "not done yet"),
    (lambda q, *a: q.transpose(1, 2), "shaped like the queries"),
    (lambda q, *a: q.double(), "return the queries' dtype"),  # (the check stopped with "Double did not match Float")
    (RightOnlyOnTheHandBuiltSteps(), "in the real engine"),
    (engine_style, "calls the engine's reference_attention"),
    (default_attention, "is the engine's default_attention"),
    (wrong_attention(softmax="queries"), "the softmax went over the wrong axis"),
    (wrong_attention(row="zero"), "through another sequence's block table"),
    (this_step_only, "attended to this step's tokens only"),
    (wrong_attention(row="layer"), "through another sequence's block table"),
    (wrong_attention(read_layer=0), "read from layer 0 of the pool"),  # (generic before: a write there was named)
    (wrong_attention(mask_dtype=torch.float32), "pass a boolean mask"),  # (SDPA adds a float mask to the scores)
    (wrong_attention(invert_mask=True), "the mask is the wrong way round"),  # (generic before: NaN everywhere)
    (lambda q, k, v, meta, *a: attention(q, k, v, dataclasses.replace(meta, block_size=8), *a),  # a global bs = 8
     "a block holds meta.block_size tokens"),  # (was a bare IndexError)
    (wrong_attention(heads_of=6), "read the head counts from the tensors"),  # a global of another model's heads
    (wrong_attention(scale_queries=True), "the scores were scaled twice"),  # q * scaling, and scale= too
]


@pytest.mark.parametrize("wrong, hint", WRONG_ATTENTION, ids=[h for _, h in WRONG_ATTENTION])
def test_ex05_wrong_attention_fails_with_its_hint(model, capsys, wrong, hint):
    assert not ex05_attention.check_paged_attention(wrong, model, slot_mapping=slot_mapping)
    out = capsys.readouterr().out
    assert out.startswith("✗") and hint in out, out
    assert "tensor(" not in out  # no output, key or slot is printed


def test_ex05_attention_checks_the_slot_mapping_first_and_wants_functions(model, capsys):
    assert not ex05_attention.check_paged_attention(attention, model, slot_mapping=_swapped)
    assert "block and offset are swapped" in capsys.readouterr().out
    assert not ex05_attention.check_paged_attention(attention, model, slot_mapping=lambda *a: None)
    assert "not done yet" in capsys.readouterr().out  # the student copy: both stubs, the slot mapping named first
    assert not ex05_attention.check_paged_attention(attention(1, 2, 3, 4, 5, 6) if False else 3, model)
    assert "pass your function itself" in capsys.readouterr().out
    assert not ex05_attention.check_slot_mapping([1, 2], model)
    assert "pass your function itself" in capsys.readouterr().out


def test_ex05_hand_built_steps_are_real_steps():
    """Each table holds exactly the blocks its tokens need, no block has two owners, and the check's
    reference slots and attention are the engine's."""
    for _, bs, seqs in ex05_attention.STEPS:
        assert all(len(t) == math.ceil((c + n) / bs) for c, n, t in seqs)
        blocks = [b for _, _, t in seqs for b in t]
        assert len(blocks) == len(set(blocks))
        tables, computed, scheduled = [t for _, _, t in seqs], [c for c, _, _ in seqs], [n for _, n, _ in seqs]
        meta = build([1] * sum(scheduled), computed, scheduled, "cpu", block_tables=tables, block_size=bs)
        assert meta.slot_mapping.tolist() == ex05_mistakes.slots(tables, computed, scheduled, bs)
    for n, (index, heads, kv_heads, head_dim, scaling) in enumerate(ex05_attention.HEADS):
        meta, q, k, v = ex05_attention._step(ex05_attention.STEPS[index], heads, kv_heads, head_dim, seed=n)
        mine, engine = ex05_attention._fresh(meta), ex05_attention._fresh(meta)
        expected = default_attention(q, k, v, engine, 1, scaling)
        assert torch.allclose(ex05_mistakes.attend(q, k, v, mine, 1, scaling), expected, atol=1e-5)


def test_ex05_every_mistake_changes_some_hand_built_step():
    """A mistake that gave the right output on every step could never be caught by them."""
    for name in ex05_mistakes.ATTENTION_MISTAKES:
        differs = False
        for n, (index, heads, kv_heads, head_dim, scaling) in enumerate(ex05_attention.HEADS):
            meta, q, k, v = ex05_attention._step(ex05_attention.STEPS[index], heads, kv_heads, head_dim, seed=n)
            right = ex05_mistakes.attend(q, k, v, ex05_attention._fresh(meta), 1, scaling)
            try:
                wrong = ex05_mistakes.attend(q, k, v, ex05_attention._fresh(meta), 1, scaling, mistake=name)
            except (IndexError, RuntimeError):
                differs = True
                continue
            differs = differs or not torch.allclose(right, wrong, atol=1e-5, equal_nan=False)
        assert differs, name


def test_ex05_engine_runs_mix_chunks_with_decodes_and_preempt(model):
    prompts = ex05_attention._prompts(None, None)
    kinds, preempted = set(), 0
    for _, m, ps, options in ex05_attention.engine_runs(model, prompts):
        seen = []

        def spy(q, k, v, meta, layer, scaling):
            seen.append(list(zip(meta.num_computed_tokens, meta.num_scheduled_tokens)))
            return default_attention(q, k, v, meta, layer, scaling)
        from cbteach import Engine, Request
        eng = Engine(m, None, kv="paged", attention=spy, **options)
        eng.run([Request(list(p), ex05_attention.MAX_NEW_TOKENS, request_id=i) for i, p in enumerate(ps)])
        preempted += sum(len(r.preempted) for r in eng.records)
        for step in seen:
            if any(n > 1 and c > 0 for c, n in step) and any(n == 1 for c, n in step):
                kinds.add("chunk beside decodes")
    assert kinds == {"chunk beside decodes"} and preempted > 0


# -- no route around the check: the engine's own pieces and the course's reference answers are refused ----------

def _course_slots(*a):
    return ex05_mistakes.slots(*a)


def _course_attend(*a):
    return ex05_mistakes.attend(*a)


SLOT_CHEATS = [(ex05_mistakes.slots, "is the course's own answer"), (_course_slots, "calls the course's own answer"),
               (__import__("functools").partial(ex05_mistakes.slots), "is the course's own answer")]
ATTENTION_CHEATS = [(ex05_mistakes.attend, "is the course's own answer"),
                    (_course_attend, "calls the course's own answer"),
                    (lambda *a: default_attention(*a), "calls the engine's default_attention")]


@pytest.mark.parametrize("cheat, words", SLOT_CHEATS, ids=[w for _, w in SLOT_CHEATS])
def test_ex05_slot_mapping_refuses_the_course_and_engine_answers(model, capsys, cheat, words):
    assert not ex05_attention.check_slot_mapping(cheat, model)
    out = capsys.readouterr().out
    assert out.startswith("✗") and words in out and "write the slot mapping yourself" in out, out


@pytest.mark.parametrize("cheat, words", ATTENTION_CHEATS, ids=[w for _, w in ATTENTION_CHEATS])
def test_ex05_attention_refuses_the_course_and_engine_answers(model, capsys, cheat, words):
    assert not ex05_attention.check_paged_attention(cheat, model, slot_mapping=slot_mapping)
    out = capsys.readouterr().out
    assert out.startswith("✗") and words in out and "write the attention yourself" in out, out


def test_ex05_the_slot_mapping_delegating_only_in_the_engine_is_refused_before_it_runs(model, capsys):
    calls = []

    def late(*a):
        calls.append(1)
        return slot_mapping(*a) if len(calls) <= len(ex05_attention.STEPS) else ex05_mistakes.slots(*a)
    assert not ex05_attention.check_slot_mapping(late, model)
    out = capsys.readouterr().out
    assert not calls and "calls the course's own answer" in out, out


class EnginesManager(__import__("cbteach.kv.manager", fromlist=["KVCacheManager"]).KVCacheManager):
    """The engine's own manager under the learner's name, with a free list to show."""

    def __init__(self, num_blocks, block_size):
        super().__init__(num_blocks, block_size)
        self.free_blocks = list(range(num_blocks))


class WrapsEnginesManager(Right):
    """Keeps the engine's manager inside and hands it every call."""

    def __init__(self, num_blocks, block_size):
        from cbteach.kv.manager import KVCacheManager

        super().__init__(num_blocks, block_size)
        self.inner = KVCacheManager(num_blocks, block_size)

    def allocate_slots(self, seq, n):
        return self.inner.allocate_slots(seq, n)


@pytest.mark.parametrize("cheat, words", [(EnginesManager, "EnginesManager.allocate_slots is still the engine's"),
                                          (WrapsEnginesManager, "__init__ calls the engine's KVCacheManager")])
def test_ex05_kv_manager_refuses_the_engines_own(model, capsys, cheat, words):
    assert not ex05.check_kv_manager(cheat, model)
    out = capsys.readouterr().out
    assert out.startswith("✗") and words in out and "write the KV manager yourself" in out, out
