"""Notebook 05: the paged cache's KV manager -- a free list and block tables -- run by the engine.

The learner's ``MyKVManager`` is plugged into a real paged engine (every call checked by the engine's
:class:`~cbteach.kv.plugged.PluggedKVManager`) on workloads that reuse blocks and preempt; the run must equal
the engine's own manager's token for token, block count for block count, preemption for preemption.
"""
from __future__ import annotations

from typing import NamedTuple

from ..engine.engine import Engine
from ..kv.plugged import PluggedKVManager
from ..bench.memory_experiments import plug
from ..core.request import Request
from . import Fail, fail, guard, is_int, is_stub, passed, raised, self_check

class Case(NamedTuple):
    """A workload for the KV manager: the paged engine's pool, and requests of forced lengths."""

    block_size: int
    num_blocks: int
    max_batch_size: int
    prompt_lens: tuple  # prompt tokens of each request
    max_new_tokens: tuple  # new tokens of each request (EOS ignored)
    token_budget: int | None = None  # tokens per step: prompts prefilled in chunks (room for the chunk, not the prompt)


# Several blocks each and blocks reused after a finish; prompts shorter than a block; one-token blocks; a pool so
# small it preempts; prompts prefilled in chunks of a token budget, so allocate_slots is asked for fewer tokens
# than the sequence has -- chunks that start and end inside a block (6 tokens, blocks of 4).
CASES = [Case(block_size=4, num_blocks=32, max_batch_size=2, prompt_lens=(5, 3, 9, 2), max_new_tokens=(7, 10, 4, 6)),
         Case(block_size=8, num_blocks=16, max_batch_size=3, prompt_lens=(3, 6, 2, 4), max_new_tokens=(2, 12, 9, 3)),
         Case(block_size=1, num_blocks=40, max_batch_size=2, prompt_lens=(3, 4, 2), max_new_tokens=(6, 5, 8)),
         Case(block_size=4, num_blocks=7, max_batch_size=3, prompt_lens=(6, 5, 7, 3), max_new_tokens=(12, 14, 10, 8)),
         Case(block_size=4, num_blocks=24, max_batch_size=3, prompt_lens=(13, 6, 9), max_new_tokens=(5, 8, 6),
              token_budget=6)]


class Watched(PluggedKVManager):
    """The engine's wrapper that checks every call's rules, raising the check's error, naming the call that raised."""

    Error = Fail

    def call_mine(self, call: str, method: str, *args):
        try:
            return super().call_mine(call, method, *args)
        except Exception as err:  # the learner's code: say what failed, and on which call
            raise Fail(f"{call} raised {raised(err)}") from None


def serve(model, case, manager_class=None) -> dict:
    """One case on a paged engine with its own manager, or ``manager_class``: outputs, blocks, preemptions."""
    engine = Engine(model, None, max_batch_size=case.max_batch_size, kv="paged", block_size=case.block_size,
                    num_blocks=case.num_blocks, watermark=0, token_budget=case.token_budget)
    watched = None
    if manager_class is not None:
        watched = Watched(manager_class(case.num_blocks, case.block_size), case.num_blocks, case.block_size)
        plug(engine, watched)
    reqs = [Request([1 + i % 5] * p, n, request_id=f"r{i}", ignore_eos=True)
            for i, (p, n) in enumerate(zip(case.prompt_lens, case.max_new_tokens))]
    done = engine.run(reqs)
    return {"outputs": [c.output_ids for c in done], "preemptions": sum(len(r.preempted) for r in engine.records),
            "blocks": [{rid: len(t) for rid, t in r.kv_usage["block_tables"].items()} for r in engine.records],
            "free_at_end": len(watched.mine.free_blocks) if watched else case.num_blocks}


def _check_init(manager_class) -> str | None:
    if is_stub(manager_class):
        return "not done yet: MyKVManager's methods are still the stubs -- write its three methods in the cell above"
    try:
        mine = manager_class(6, 4)
    except Exception as err:
        return f"MyKVManager(6, 4) raised {raised(err)}"
    free = getattr(mine, "free_blocks", None)
    if free is None or isinstance(free, (str, bytes)) or not hasattr(free, "__len__"):
        return "MyKVManager(num_blocks, block_size) should keep self.free_blocks: the ids of the free blocks"
    if not all(is_int(b) for b in free):
        return f"MyKVManager(6, 4).free_blocks is {list(free)!r}: block ids are the ints 0 .. num_blocks - 1"
    if sorted(free) != list(range(6)):
        return f"MyKVManager(6, 4).free_blocks is {list(free)!r}: a new pool has every block 0 .. num_blocks - 1 free"
    return None


@self_check
def check_kv_manager(manager_class, model) -> bool:
    """``manager_class(num_blocks, block_size)``: a KV manager with ``free_blocks``, ``allocate_slots(seq, n)``
    (return the blocks added, or None with nothing changed) and ``free(seq)``. ``model``: the notebook's."""
    if not isinstance(manager_class, type):
        return fail(f"pass your class itself (MyKVManager, not MyKVManager(...)); got {type(manager_class).__name__}")
    problem = guard.refusal("kv_manager", manager_class) or _check_init(manager_class)
    if problem:
        return fail(problem)
    steps = preemptions = 0
    for case in CASES:
        where = (f"(block_size {case.block_size}, {case.num_blocks} blocks, {len(case.prompt_lens)} requests"
                 + (f", prefilled in chunks of {case.token_budget} tokens)" if case.token_budget else ")"))
        expected = serve(model, case)
        try:
            got = serve(model, case, manager_class)
        except (Fail, ValueError) as err:  # ValueError: a method or free_blocks missing
            return fail(f"{where}: {err}")
        if got["free_at_end"] != case.num_blocks:
            return fail(f"{where}: when every request had finished, not every block was back in the free list")
        if got["preemptions"] != expected["preemptions"] or got["blocks"] != expected["blocks"]:
            return fail(f"{where}: the engine ran differently with your manager (blocks per sequence or preemptions "
                        "differ from its own manager's): check when allocate_slots refuses room")
        if got["outputs"] != expected["outputs"]:
            return fail(f"{where}: the generated tokens changed: a sequence read K/V that was not its "
                        "own -- check the order of blocks in each block table")
        steps += len(expected["blocks"])
        preemptions += expected["preemptions"]
    return passed(f"the real engine ran on your KV manager: {len(CASES)} workloads, {steps} steps, "
                  f"{preemptions} preemptions, the same tokens and the same blocks per sequence at every step "
                  "as with its own manager, and every block back in the free list at the end")
