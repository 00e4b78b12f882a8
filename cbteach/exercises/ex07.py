"""Notebook 07: an honest benchmark harness, and a check that catches every shortcut.

The harness times real engines on a :class:`Clock` the check controls -- it moves only while an engine runs, by
costs the check sets (a cold first run, drift, a hiccup, a lucky run) -- so the check knows which runs were timed and what each
took; one engine is right on its first run only, another wrong on every run.
"""
from __future__ import annotations

import math
import numbers
import statistics

from ..engine.engine import Engine
from ..core.request import Request
from ..engine.static import static_batching
from . import ask, fail, first_mistake, need_function, passed, self_check

COLD = 6.0     # a first run costs this many times a warm one (allocation, lazy imports, caches)
DRIFT = 0.08   # each run costs this much more than the one before it, whichever engine ran (a machine slowing)
HICCUP = 5.0   # one run of each engine -- its second timed -- is this many times slower (another process woke up)
LUCKY = 0.6    # and its third timed run this many times faster (a clock boost): the times are not in order
COST = {"static": 1.0, "paged": 0.7, "paged (stale state)": 0.5,  # seconds of a warm run, on the check's clock
        "paged (wrong tokens)": 0.4}
BUGGY = {"stale": "paged (stale state)", "wrong": "paged (wrong tokens)"}  # a case's bug -> the engine that has it
REPEATS = (3, 4)  # (an even count too: its median is the mean of the two middle runs)


class Clock:
    """A clock that moves only while an engine runs, and remembers who read it and when."""

    def __init__(self):
        self.now, self.events = 0.0, []  # events: ("read",) or ("run", name, cost)

    def __call__(self) -> float:
        self.events.append(("read",))
        return self.now

    def run(self, name: str, cost: float) -> None:
        self.events.append(("run", name, cost))
        self.now += cost


def _requests(n: int = 6) -> list[Request]:
    return [Request([1 + i % 5] * (2 + i % 3), 1 + (3 * i) % 7, request_id=f"r{i}", ignore_eos=True)
            for i in range(n)]


def engine_runs(model, clock: Clock, repeat: int = 3, batch_size: int = 2, stale: bool = False,
                wrong: bool = False) -> dict:
    """The engines the check times: each entry runs a real engine once and returns its outputs. With
    ``stale``, a third engine is correct on its first run and its last only (state leaking from one run into the
    next, cleared by the time the last round comes: a harness that compares one round of tokens misses it);
    with ``wrong``, a third engine is wrong on every run, its first included.
    Costs on ``clock``: a cold first run, drift, a hiccup on each engine's second timed run and a lucky third (so
    the median is neither the middle run nor the last, unless the times are sorted)."""
    calls = {}

    def outputs(name, k):
        if name == "static":
            return [list(c.output_ids) for c in static_batching(model, None, _requests(), batch_size)]
        engine = Engine(model, None, max_batch_size=batch_size, kv="paged", keep_records=False)
        out = [list(c.output_ids) for c in engine.run(_requests())]
        if (name == "paged (stale state)" and 1 < k <= repeat) or name == "paged (wrong tokens)":
            out[-1] = [out[-1][0]] + out[-1][:-1]  # the bug: one request's tokens shifted by a leftover
        return out

    def timed(name):
        def run():
            k = calls[name] = calls.get(name, 0) + 1
            ran = sum(1 for e in clock.events if e[0] == "run")  # how long the machine has been busy
            clock.run(name, COST[name] * (1 + DRIFT * ran) * {1: COLD, 3: HICCUP, 4: LUCKY}.get(k, 1))
            return outputs(name, k)
        return run

    bugs = {BUGGY[b] for b, on in (("stale", stale), ("wrong", wrong)) if on}
    # The buggy engine between the right ones: a harness that keeps only the last comparison sees a right one.
    names = ["static", *sorted(bugs), "paged"]
    return {name: timed(name) for name in names}


def _timed_flags(events) -> list[bool]:
    """For each run in the clock's log: was it timed on its own (a reading right before and right after)? A
    harness that reads twice around each run uses each reading once; one that reads once between runs shares it."""
    own_pairs = any(a[0] == b[0] == "read" for a, b in zip(events, events[1:]))
    flags, used = [], -1  # used: the index of the last reading that ended a timing
    for i, e in enumerate(events):
        if e[0] != "run":
            continue
        before = i > 0 and events[i - 1][0] == "read" and not (own_pairs and used == i - 1)
        after = i + 1 < len(events) and events[i + 1][0] == "read"
        flags.append(before and after)
        used = i + 1 if before and after else used
    return flags


def _timed_runs(events) -> tuple[dict, list, list]:
    """From the clock's log: each engine's timed durations, the names of untimed runs in order, and the
    timed runs' names in order (:func:`_timed_flags` says which runs were timed)."""
    durations, untimed, order = {}, [], []
    for e, timed in zip([e for e in events if e[0] == "run"], _timed_flags(events)):
        if timed:
            durations.setdefault(e[1], []).append(e[2])
            order.append(e[1])
        else:
            untimed.append(e[1])
    return durations, untimed, order


_UNSORTED = "the median is the middle of the times sorted: they came in the order the runs ran, not by duration"
# What a harness reports instead of the median: (the statistic, its hint).
STATISTICS = [(statistics.fmean, "one slow run (a hiccup) pulls the mean along: report the median of the timed runs"),
              (min, "the fastest run is the luckiest one, not the typical one: report the median"),
              (sum, "that is the total of the timed runs; report the median of them, one run's worth"),
              (lambda t: sorted(t)[len(t) // 2], "with an even number of runs the median is the mean of the two "
                                                 "middle ones (statistics.median), not the upper of them"),
              (lambda t: sorted(t)[(len(t) - 1) // 2], "with an even number of runs the median is the mean of the two "
                                                       "middle ones (statistics.median), not the lower of them"),
              (lambda t: 1000 * statistics.median(t), "the clock reads seconds: report seconds, not milliseconds"),
              (lambda t: t[len(t) // 2] if len(t) % 2 else (t[len(t) // 2 - 1] + t[len(t) // 2]) / 2, _UNSORTED),
              (lambda t: t[len(t) // 2], _UNSORTED)]


def _one_reading_a_round(events, names, repeat, medians) -> bool:
    """Whether ``medians`` are those of times read from one reading at the start of each round (after one warm-up
    run of each engine): each run's time the round's total so far."""
    runs = [e for e in events if e[0] == "run"][len(names):]
    if len(runs) != repeat * len(names):
        return False
    totals = {name: [] for name in names}
    for r in range(repeat):
        total = 0.0
        for _, name, cost in runs[r * len(names):(r + 1) * len(names)]:
            total += cost
            totals[name].append(total)
    return all(isinstance(medians.get(n), numbers.Real) and totals[n]
               and math.isclose(medians[n], statistics.median(totals[n]), rel_tol=1e-6) for n in names)


def _diagnose(events, names, repeat, medians, same, truth_same, wrong_from_the_start=False) -> str | None:
    """The first shortcut the clock's log or the answer shows, as a hint; None when all is right."""
    runs = [e[1] for e in events if e[0] == "run"]
    if not any(e[0] == "read" for e in events):
        return "your harness never read the clock it was given: time each run with clock(), not another timer"
    if any(name not in runs for name in names):
        return "some engine was never run: run every engine in runs"
    durations, _, order = _timed_runs(events)
    timed = _timed_flags(events)
    if any(timed[runs.index(name)] for name in names):  # each engine's first run
        # (timed, but its time left out of the median: a warm-up too)
        later = {name: d[1:] for name, d in durations.items()}
        if not (sorted(order[:len(names)]) == sorted(names) and all(
                len(later.get(n, [])) == repeat and isinstance(medians.get(n), numbers.Real)
                and math.isclose(medians[n], statistics.median(later[n]), rel_tol=1e-6) for n in names)):
            return "an engine's first run pays one-off costs: warm every engine up with one untimed run first"
        durations, order = later, order[len(names):]
    if not durations:
        return ("no single run was timed on its own: one slow run hides in a total; read the clock right before and "
                "right after each run")
    if any(len(durations.get(name, [])) != repeat for name in names):
        if _one_reading_a_round(events, names, repeat, medians):
            return ("each run's time counts the runs before it in its round: read the clock right before each run, "
                    "not once a round")
        return "each engine should be timed exactly repeat times (warm-up not counted), each run on its own"
    if any(sorted(order[r * len(names):(r + 1) * len(names)]) != sorted(names) for r in range(repeat)):
        return ("all of one engine's runs, then the next engine's: a machine that drifts (a hot CPU, another "
                "job starting) then favours whichever engine ran first; run every engine once per round")
    for name in names:
        mine = medians.get(name)
        if not isinstance(mine, numbers.Real) or isinstance(mine, bool) or not math.isfinite(mine):
            return f"medians[{name!r}] should be a number of seconds; got {mine!r}"
        if not math.isclose(mine, statistics.median(durations[name]), rel_tol=1e-6):
            hint = first_mistake(STATISTICS, lambda stat: math.isclose(mine, stat(durations[name]), rel_tol=1e-6))
            if hint is None and mine < 0:
                hint = f"medians[{name!r}] is negative: a run's time is the clock after it minus the clock before it"
            return hint or f"medians[{name!r}] is not the median of the runs your harness timed"
    if same is not truth_same:
        if truth_same:
            return "every engine produced the same tokens here, yet your harness says they differ"
        if wrong_from_the_start:
            return ("an engine that is wrong from its first run on agrees with itself: compare every engine's "
                    "tokens with one reference (the first engine's), not each engine with its own first run")
        return ("a fast engine that gives other tokens is wrong, and a bug can show on a later run only (state left "
                "over): compare the tokens of every run")
    return None


@self_check
def check_benchmark(benchmark, model) -> bool:
    """``benchmark(runs, repeat, clock)`` should warm up, time interleaved repeats one by one with
    ``clock``, and return ``({name: median seconds}, same_tokens)``. ``model``: the notebook's model;
    every engine the check times runs it for real."""
    need_function(benchmark, "benchmark")
    cases = [(r, bug) for bug in (None, "stale") for r in REPEATS] + [(REPEATS[0], "wrong")]
    for repeat, bug in cases:
        clock = Clock()
        runs = engine_runs(model, clock, repeat, stale=bug == "stale", wrong=bug == "wrong")
        got = ask(benchmark, dict(runs), repeat, clock, shown="benchmark(runs, repeat, clock)")
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and isinstance(got[0], dict)
                and type(got[1]).__name__ in ("bool", "bool_")):  # (a NumPy bool is a bool too)
            return fail(f"benchmark should return a pair (dict of medians, bool); got {got!r:.80}")
        hint = _diagnose(clock.events, list(runs), repeat, got[0], bool(got[1]), truth_same=bug is None,
                         wrong_from_the_start=bug == "wrong")
        if hint:
            which = (f"{len(runs)} engines"
                     f"{', one with a stale-state bug' if bug == 'stale' else ', one always wrong' if bug else ''}, "
                     f"repeat={repeat}")
            return fail(f"on the check's workload ({which}): {hint}")
    return passed(f"your harness warms up, interleaves, takes medians and compares every run's tokens "
                  f"({len(cases)} workloads, engines run for real)")
