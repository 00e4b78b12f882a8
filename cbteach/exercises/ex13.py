"""Notebook 13: predict what tensor parallelism keeps on each rank and sends between them.

The learner writes two functions and :func:`check_tp` runs them against the real thing:

* ``kv_heads_of_rank(rank, world_size, num_heads, num_kv_heads)`` -- the KV heads rank ``rank``
  holds in its pool, checked against :mod:`cbteach.parallel.shard`'s layout (the one the worker
  processes really build) on common shapes, grouped-query attention with fewer KV heads than
  ranks included;
* ``all_reduce_bytes(num_layers, num_tokens, hidden_size, dtype_bytes)`` -- the bytes one rank sends
  into one step's all-reduces, checked against the counts a real two-process run recorded (the
  runner's ``comm_log``: its forward hooks count every all-reduce and its bytes).

A wrong answer gets a hint naming the idea it missed, never the right value.
"""
from __future__ import annotations

from ..parallel.shard import Layout
from . import is_int, report, self_check

# (num_heads, num_kv_heads, world_size): bierce and the course's tiny models, and real shapes.
SHAPES = [(6, 2, 2), (4, 2, 2), (4, 1, 2), (8, 2, 4), (8, 8, 4), (32, 8, 8), (64, 8, 16), (32, 8, 2)]


def _layout(heads: int, kv: int, world: int) -> Layout:
    return Layout(arch="llama", world_size=world, num_heads=heads, num_kv_heads=kv, head_dim=8, hidden_size=8 * heads,
                  intermediate_size=16 * world, num_layers=1)


def _kv_hint(got, truth, rank, heads, kv, world) -> str:
    if kv < world and not got:
        return ("with fewer KV heads than ranks a KV head cannot be split: it is replicated, so every rank holds "
                "one. Which one do this rank's query heads read?")
    if len(got) == kv and kv > 1:
        return ("each rank keeps only the KV heads its own query heads read -- that is why a rank's KV pool is "
                "smaller than the whole model's")
    if kv < world and got == [rank % kv]:
        return ("the copies of one KV head sit on consecutive ranks, not round robin: the ranks whose query heads "
                "read KV head 0 come first, then those that read KV head 1")
    return ("a rank holds exactly the KV heads its own query heads read: which query heads does this rank "
            "compute, and which KV head does each of them read under grouped-query attention?")


def _bytes_hint(got, truth, layers, tokens, hidden, dtype_bytes, world) -> str:
    if got * 2 == truth:  # one all-reduce per layer -- or, on two ranks, a rank's half of the width
        return ("a Megatron layer has two row-parallel products -- attention's output projection and the MLP's down "
                "projection -- and each is followed by its own all-reduce of a full-width [tokens, hidden_size] "
                "tensor (a rank's partial output is already full width)")
    if got * dtype_bytes == truth:
        return "count bytes, not elements: every element of the hidden states is dtype_bytes bytes"
    if got == truth * world:
        return ("count what one rank sends in: every rank all-reduces the same full-size tensor, however many ranks "
                "there are")
    if got * world == truth:
        return ("each rank's partial output is already full width ([tokens, hidden_size]): the all-reduce sums full "
                "hidden states, not a rank's slice of them")
    if tokens > 1 and got * tokens == truth:
        return "the all-reduced tensor is the step's hidden states: one row per token in the packed batch"
    return ("one step all-reduces the output of every row-parallel module: a [tokens, hidden_size] tensor each time, "
            "in every layer")


@self_check
def check_tp(kv_heads_of_rank, all_reduce_bytes, comm_log, *, num_layers: int, hidden_size: int,
             dtype_bytes: int = 4, world_size: int = 2) -> bool:
    """Check ``kv_heads_of_rank`` on :data:`SHAPES` against the real layout, and ``all_reduce_bytes``
    against ``comm_log`` -- a real tensor-parallel run's per-step counts (``runner.comm_log``; the
    run's ``num_layers``, ``hidden_size``, ``dtype_bytes`` and ``world_size``). Prints a line each;
    ``True`` when both are right."""
    if not callable(kv_heads_of_rank) or not callable(all_reduce_bytes):
        return report(False, "", "pass your two functions (not their results): check_tp(kv_heads_of_rank, "
                                 "all_reduce_bytes, runner.comm_log, ...)")
    if not comm_log:
        return report(False, "", "comm_log is empty: pass the runner's comm_log after the tensor-parallel run")
    ok = True
    for heads, kv, world in SHAPES:
        layout = _layout(heads, kv, world)
        for rank in range(world):
            truth = list(layout.kv_heads(rank))
            got = kv_heads_of_rank(rank, world, heads, kv)
            if got is None or isinstance(got, (str, float)):
                return report(False, "", f"kv_heads_of_rank returned {got!r}: return the list of KV head indices "
                                         "the rank holds, e.g. [0] or [2, 3]")
            got = list(got) if not isinstance(got, int) else [got]
            if got != truth:
                ok = report(False, "", f"kv_heads_of_rank({rank}, world_size={world}, num_heads={heads}, "
                                       f"num_kv_heads={kv}) returned {got}: "
                                       + _kv_hint(got, truth, rank, heads, kv, world))
                break
        if not ok:
            break
    if ok:
        report(True, f"kv_heads_of_rank: every rank of {len(SHAPES)} shapes holds the KV heads the real layout gives "
                     "it (replicated when there are fewer KV heads than ranks)", "")
    bytes_ok = True
    for step in comm_log:
        truth, tokens = step["all_reduce_bytes"], step["num_tokens"]
        got = all_reduce_bytes(num_layers, tokens, hidden_size, dtype_bytes)
        if not is_int(got):
            return report(False, "", f"all_reduce_bytes returned {got!r}: return a whole number of bytes (an int)")
        if got != truth:
            bytes_ok = report(False, "", f"all_reduce_bytes(num_layers={num_layers}, num_tokens={tokens}, hidden_size="
                                         f"{hidden_size}, dtype_bytes={dtype_bytes}) returned {got!r}, not what the "
                                         "run's ranks sent: "
                                         + _bytes_hint(got, truth, num_layers, tokens, hidden_size, dtype_bytes,
                                                       world_size))
            break
    if bytes_ok:
        report(True, f"all_reduce_bytes matches all {len(comm_log)} steps the two ranks really ran", "")
    return ok and bytes_ok
