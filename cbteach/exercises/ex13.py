"""Notebook 13: what tensor parallelism keeps on each rank and sends between them.

``kv_heads_of_rank`` is compared with :mod:`cbteach.parallel.shard`'s layout, ``all_reduce_bytes`` with the ring's
bytes per rank on a real two-process run's all-reduces and a second shape; a wrong answer is named by the typical
mistake whose formula gives it. An answer that is or calls what it is compared with is refused.
"""
from __future__ import annotations

import inspect
import numbers
from typing import NamedTuple

from ..parallel.shard import Layout
from ..sim.cost import ring_all_reduce_bytes
from . import Fail, fail, first_mistake, guard, is_stub, passed, raised, report, self_check


class Shape(NamedTuple):
    num_heads: int
    num_kv_heads: int
    world_size: int


# bierce and the course's tiny models, and real shapes.
SHAPES = [Shape(num_heads=6, num_kv_heads=2, world_size=2), Shape(num_heads=4, num_kv_heads=2, world_size=2),
          Shape(num_heads=4, num_kv_heads=1, world_size=2), Shape(num_heads=8, num_kv_heads=2, world_size=4),
          Shape(num_heads=8, num_kv_heads=8, world_size=4), Shape(num_heads=32, num_kv_heads=8, world_size=8),
          Shape(num_heads=64, num_kv_heads=8, world_size=16), Shape(num_heads=32, num_kv_heads=8, world_size=2)]


def _kv_hint(got, rank, heads, kv, world) -> str:
    if kv < world and not got:
        return ("with fewer KV heads than ranks a KV head cannot be split: it is replicated, so every rank holds "
                "one. Which one do this rank's query heads read?")
    if len(got) == kv and kv > 1:
        return "each rank keeps only the KV heads its own query heads read: its KV pool is smaller than the model's"
    if kv < world and got == [rank % kv]:
        return "the copies of one KV head sit on consecutive ranks, not round robin: KV head 0's readers come first"
    per_rank, copies = max(1, kv // world), max(1, world // kv)
    if got == list(range(rank * heads // world, (rank + 1) * heads // world)) and heads != kv:
        return ("those are the query heads this rank computes (num_heads split over the ranks): which KV heads do they "
                "read?")
    if per_rank > 1 and len(got) == 1:
        return (f"one KV head per rank: with more KV heads than ranks ({kv} over {world}) a rank holds {per_rank} of "
                "them, all those its query heads read")
    if per_rank > 1 and got == list(range(rank // copies, rank // copies + per_rank)):
        return (f"the ranks' KV heads overlap: each rank holds {per_rank} of them, so each rank's first KV head is "
                f"{per_rank} past the one before it")
    return "a rank holds exactly the KV heads its own query heads read: which query heads does it compute?"


# A second shape, so that a mistake by the number of layers and one by the bytes per element differ.
SECOND_SHAPE = {"num_layers": 5, "hidden_size": 96, "dtype_bytes": 2, "tokens": (1, 7)}
WORLD_SIZES = (2, 4, 8)

# Typical mistakes: (the wrong answer from the right one t and the case's L, T, h, b, N; the hint).
_MISTAKES = [
    (lambda t, L, T, h, b, N: t * N / (2 * (N - 1)), "that is the size of the all-reduced tensors, not what one rank "
     "sends (or the ring's factor 2 (N - 1) / N rounded down by integer division, //, or world_size left out, as if "
     "there were always 2 ranks): a ring all-reduce is a "
     "reduce-scatter then an all-gather, each sending N - 1 chunks of 1/N"),
    (lambda t, L, T, h, b, N: t * N / (N - 1), "each half of the ring sends N - 1 chunks, not N: a rank never "
     "sends its own chunk to itself"),
    (lambda t, L, T, h, b, N: t * N / (N + 1), "a chunk is 1/N of the tensor (N ranks), not 1/(N + 1)"),
    (lambda t, L, T, h, b, N: t * N * N / ((N - 1) * (N - 1)), "the ring's factor is upside down: a rank sends "
     "2 (N - 1) / N of the tensor (N - 1 chunks of 1/N, twice), not 2 N / (N - 1)"),
    (lambda t, L, T, h, b, N: 2 * L * 2 * (b - 1) / b * T * h * N, "dtype_bytes and world_size are swapped: the "
     "arguments come as (num_layers, num_tokens, hidden_size, dtype_bytes, world_size)"),
    (lambda t, L, T, h, b, N: 8 * t, "count bytes, not bits"),
    (lambda t, L, T, h, b, N: 2 * t, "count what one rank sends, not what it sends and receives"),
    (lambda t, L, T, h, b, N: t * N, "a rank sends 2 (N - 1) chunks of 1/N of the tensor, not 2 (N - 1) whole tensors"),
    (lambda t, L, T, h, b, N: t / 2, "a Megatron layer has two row-parallel products, each all-reduced -- and each "
     "all-reduce is a reduce-scatter *and* an all-gather"),
    (lambda t, L, T, h, b, N: 1.5 * t, "a Megatron layer all-reduces twice, not three times"),
    (lambda t, L, T, h, b, N: t / L, "every layer all-reduces: multiply by the number of layers"),
    (lambda t, L, T, h, b, N: t / b, "count bytes, not elements: an element is dtype_bytes bytes"),
    (lambda t, L, T, h, b, N: t / N, "each rank's partial output is already full width: the all-reduce sums full "
     "hidden states, not a rank's slice"),
    (lambda t, L, T, h, b, N: t / T, "the all-reduced tensor is the step's hidden states: one row per token"),
]


def _generic(answers: list, cases: list) -> str:
    """The hint for a mistake :data:`_MISTAKES` does not know: what the wrong cases have in common."""
    wrong = sorted({args[4] for a, (args, t) in zip(answers, cases) if not _same(a, t)})
    right = sorted({args[4] for args, _ in cases} - set(wrong))
    if right:
        return (f"right at world_size {', '.join(map(str, right))}, wrong at {', '.join(map(str, wrong))}: does your "
                "answer change with world_size as what one rank sends does?")
    ratios = {round(a / t, 9) for a, (_, t) in zip(answers, cases) if t}
    if len(ratios) == 1:
        return (f"not one of the typical mistakes the check knows; every answer is {ratios.pop():.4g} times what one "
                "rank sends -- look for the factor that is off by that much")
    return ("not one of the typical mistakes the check knows; work one case out by hand, for two ranks and then for "
            "four: what one layer all-reduces, how often, and which share of it one rank sends")


def _cases(comm_log, num_layers, hidden_size, dtype_bytes):
    """(arguments, truth) for every case: the real run's steps at 2, 4 and 8 ranks, then the second shape."""
    L, h, b = SECOND_SHAPE["num_layers"], SECOND_SHAPE["hidden_size"], SECOND_SHAPE["dtype_bytes"]
    steps = [(num_layers, s["num_tokens"], hidden_size, dtype_bytes, s["all_reduce_bytes"])  # the tensors' bytes
             for s in comm_log[:4]] + [(L, T, h, b, 2 * L * T * h * b) for T in SECOND_SHAPE["tokens"]]
    return [((L, T, h, b, n), ring_all_reduce_bytes(payload, n)) for L, T, h, b, payload in steps for n in WORLD_SIZES]


def _same(a, b) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1.0)


def _gives(fn, args, want) -> bool:
    """Whether ``fn(*args)`` is ``want`` (what it raises counts as no)."""
    try:
        got = fn(*args)
        return [h.item() if hasattr(h, "item") else h for h in got] == want
    except Exception:  # noqa: BLE001  (the learner's code, tried on other arguments)
        return False


def _swapped_counts(fn) -> bool:
    """Whether ``fn`` is right on every shape when given the head counts the other way round."""
    return all(_gives(fn, (rank, world, kv, heads), list(_layout(heads, kv, world).kv_heads(rank)))
               for heads, kv, world in SHAPES for rank in range(world))


def _layout(heads: int, kv: int, world: int) -> Layout:
    return Layout(arch="llama", world_size=world, num_heads=heads, num_kv_heads=kv, head_dim=8,
                  hidden_size=8 * heads, intermediate_size=16 * world, num_layers=1)


def _kv_wrong(kv_heads_of_rank) -> str | None:
    """What ``kv_heads_of_rank`` gets wrong on :data:`SHAPES` (None: nothing)."""
    for heads, kv, world in SHAPES:
        layout = _layout(heads, kv, world)
        for rank in range(world):
            call = f"kv_heads_of_rank({rank}, world_size={world}, num_heads={heads}, num_kv_heads={kv})"
            try:
                got = kv_heads_of_rank(rank, world, heads, kv)
            except ZeroDivisionError as err:
                raise Fail(f"{call} raised {raised(err)} -- a count made with // is 0 for this shape: with more KV "
                           "heads than ranks a rank holds several of them, with fewer each is replicated") from None
            except Exception as err:  # noqa: BLE001  (the learner's code: said with the shape it failed on)
                raise Fail(f"{call} raised {raised(err)}") from None
            if got is None and is_stub(kv_heads_of_rank):
                raise Fail("not done yet: kv_heads_of_rank is still the stub -- write it in the cell above")
            if got is None or isinstance(got, (str, float)):
                raise Fail(f"kv_heads_of_rank returned {got!r}: return the list of KV head indices the "
                           "rank holds, e.g. [0] or [2, 3]")
            if isinstance(got, numbers.Integral) or getattr(got, "ndim", None) == 0:  # one head, maybe NumPy's or a 0-d tensor
                got = [got]
            if not hasattr(got, "__iter__"):
                raise Fail(f"kv_heads_of_rank returned {got!r}: return the list of KV head indices the rank holds, "
                           "e.g. [0] or [2, 3]")
            got = [h.item() if hasattr(h, "item") else h for h in got]  # (NumPy's or torch's scalars as numbers)
            if got != list(layout.kv_heads(rank)):
                if _swapped_counts(kv_heads_of_rank):
                    return (f"{call} returned {got}: the arguments come as (rank, world_size, num_heads, "
                            "num_kv_heads) -- yours takes the head counts the other way round")
                return f"{call} returned {got}: " + _kv_hint(got, rank, heads, kv, world)
    return None


@self_check
def check_tp(kv_heads_of_rank, all_reduce_bytes, comm_log, *, num_layers: int, hidden_size: int,
             dtype_bytes: int = 4, world_size: int = 2) -> bool:
    """``kv_heads_of_rank`` on :data:`SHAPES` against the real layout, ``all_reduce_bytes`` at 2, 4 and 8 ranks on
    ``comm_log``'s tensors (a real run's) and on :data:`SECOND_SHAPE`; a line each, ``True`` when both are right."""
    if not callable(kv_heads_of_rank) or not callable(all_reduce_bytes):
        return fail("pass your two functions (not their results): check_tp(kv_heads_of_rank, "
                    "all_reduce_bytes, runner.comm_log, ...)")
    if not comm_log:
        return fail("comm_log is empty: pass the runner's comm_log after the tensor-parallel run")
    refused = guard.refusal("tp", kv_heads_of_rank) or guard.refusal("tp", all_reduce_bytes)
    if refused:
        return fail(refused)
    wrong = _kv_wrong(kv_heads_of_rank)
    ok = report(wrong is None, f"kv_heads_of_rank: every rank of {len(SHAPES)} shapes holds the KV heads the real "
                               "layout gives it (replicated when there are fewer KV heads than ranks)", wrong)
    try:
        sig = inspect.signature(all_reduce_bytes)
    except (TypeError, ValueError):
        sig = None  # (no signature to read: the calls will tell)
    try:
        if sig is not None:
            sig.bind(*range(5))  # called with the five, as the check calls it (extra arguments with defaults: fine)
    except TypeError:
        arity = sum(p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.parameters.values())
        return fail(f"all_reduce_bytes takes {arity} arguments: it needs five -- num_layers, num_tokens, "
                    "hidden_size, dtype_bytes and world_size (what one rank sends depends on the ranks)")
    cases = _cases(comm_log, num_layers, hidden_size, dtype_bytes)
    answers = []
    for args, _ in cases:
        got = all_reduce_bytes(*args)
        if not isinstance(got, numbers.Real) or isinstance(got, bool):
            return fail(f"all_reduce_bytes returned {got!r}: return a number of bytes")
        answers.append(float(got))
    wrong = [(args, got) for got, (args, t) in zip(answers, cases) if not _same(got, t)]
    if wrong:
        (L, T, h, b, n), got = wrong[0]
        gives = lambda mistake: all(_same(a, mistake(t, *args)) for a, (args, t) in zip(answers, cases))  # noqa: E731
        return fail(f"all_reduce_bytes(num_layers={L}, num_tokens={T}, hidden_size={h}, dtype_bytes={b}, "
                    f"world_size={n}) returned {got:g}, not what one rank sends ({len(wrong)} of "
                    f"{len(cases)} cases wrong): " + (first_mistake(_MISTAKES, gives) or _generic(answers, cases))) and ok
    passed(f"all_reduce_bytes matches the ring's bytes per rank at {', '.join(map(str, WORLD_SIZES))} ranks, on "
           f"the tensors the two ranks really all-reduced and on a second model shape")
    return ok
