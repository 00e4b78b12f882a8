"""Notebook 07's self-check: an honest harness passes; each shortcut fails with its own hint, never the answer."""
import statistics

import pytest

from cbteach.exercises import ex07
from conftest import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def right(runs, repeat, clock):
    first = None
    for run in runs.values():  # warm-up, untimed; its tokens are the reference
        out = run()
        first = out if first is None else first
    times, same = {name: [] for name in runs}, True
    for _ in range(repeat):  # rounds: every engine once per round
        for name, run in runs.items():
            start = clock()
            out = run()
            times[name].append(clock() - start)
            same = same and out == first
    return {n: statistics.median(t) for n, t in times.items()}, same


def make(warm=True, interleave=True, stat=statistics.median, every_run=True, per_run=True, use_clock=True):
    """A harness with one shortcut switched on."""
    import time

    def harness(runs, repeat, clock):
        tick = clock if use_clock else time.perf_counter
        first = None
        if warm:
            for run in runs.values():
                out = run()
                first = out if first is None else first
        times, same = {n: [] for n in runs}, True
        order = ([(r, n) for r in range(repeat) for n in runs] if interleave
                 else [(r, n) for n in runs for r in range(repeat)])
        if not per_run:
            for name, run in runs.items():
                start = tick()
                for _ in range(repeat):
                    out = run()
                    first = out if first is None else first
                times[name] = [(tick() - start) / repeat] * repeat
            return {n: stat(t) for n, t in times.items()}, True
        for _, name in order:
            start = tick()
            out = runs[name]()
            times[name].append(tick() - start)
            first = out if first is None else first
            if every_run:
                same = same and out == first
        return {n: stat(t) for n, t in times.items()}, same
    return harness


def test_the_clock_log_finds_the_timed_runs(model):
    clock = ex07.Clock()
    runs = ex07.engine_runs(model, clock, stale=True)
    medians, same = right(runs, 3, clock)
    durations, untimed, order = ex07._timed_runs(clock.events)
    assert untimed == list(runs) and order == list(runs) * 3 and not same
    assert all(abs(medians[n] - statistics.median(durations[n])) < 1e-9 for n in runs)
    # the costs make every shortcut visible: the median differs from the mean, the minimum, the last run and the
    # middle run unsorted (of three runs, the last is then the fastest)
    for d in durations.values():
        assert len({round(statistics.median(d), 9), round(statistics.fmean(d), 9), round(min(d), 9),
                    round(d[len(d) // 2], 9)}) == 4 and d[-1] != statistics.median(d)


def test_the_stale_engine_is_right_once_then_wrong(model):
    runs = ex07.engine_runs(model, ex07.Clock(), stale=True)
    first, again, reference = runs["paged (stale state)"](), runs["paged (stale state)"](), runs["static"]()
    assert first == reference != again and runs["paged"]() == reference


def shared_readings(runs, repeat, clock):
    """Also honest: one reading between runs, each run timed from the reading before it to the one after."""
    import numpy as np

    first = [run() for run in runs.values()][0]
    times, same, then = {name: [] for name in runs}, np.True_, clock()
    for _ in range(repeat):
        for name, run in runs.items():
            out = run()
            now = clock()
            times[name].append(now - then)
            then, same = now, same & (out == first)
    return {n: statistics.median(t) for n, t in times.items()}, same  # a NumPy bool


def warms_each_then_times_it(runs, repeat, clock):
    """Warms every engine up -- each right before its own timed runs, all of them in a row: not interleaved."""
    first, times, same = None, {name: [] for name in runs}, True
    for name, run in runs.items():
        out = run()
        first = out if first is None else first
        same = same and out == first
        for _ in range(repeat):
            start = clock()
            out = run()
            times[name].append(clock() - start)
            same = same and out == first
    return {n: statistics.median(t) for n, t in times.items()}, same


def warm_up_timed_and_dropped(runs, repeat, clock):
    """Also honest: the warm-up round is timed like the others, and its times are left out of the medians."""
    first, same, times = None, True, {name: [] for name in runs}
    for _ in range(repeat + 1):
        for name, run in runs.items():
            start = clock()
            out = run()
            times[name].append(clock() - start)
            first = out if first is None else first
            same = same and out == first
    return {n: statistics.median(t[1:]) for n, t in times.items()}, same


def last_comparison_only(runs, repeat, clock):
    """``same`` overwritten by each run's comparison, not accumulated: only the last run decides it."""
    first = [run() for run in runs.values()][0]
    times, same = {name: [] for name in runs}, True
    for _ in range(repeat):
        for name, run in runs.items():
            start = clock()
            out = run()
            times[name].append(clock() - start)
            same = out == first
    return {n: statistics.median(t) for n, t in times.items()}, same


def one_reading_a_round(runs, repeat, clock):
    """The clock read once at the start of each round: each run's time counts the runs before it."""
    first = [run() for run in runs.values()][0]
    times, same = {name: [] for name in runs}, True
    for _ in range(repeat):
        start = clock()
        for name, run in runs.items():
            out = run()
            times[name].append(clock() - start)
            same = same and out == first
    return {n: statistics.median(t) for n, t in times.items()}, same


def last_round_only(runs, repeat, clock):
    """Only the last round's tokens compared."""
    first = [run() for run in runs.values()][0]
    times = {name: [] for name in runs}
    for _ in range(repeat):
        outs = []
        for name, run in runs.items():
            start = clock()
            outs.append(run())
            times[name].append(clock() - start)
    return {n: statistics.median(t) for n, t in times.items()}, all(o == first for o in outs)


def as_a_list(runs, repeat, clock):  # the pair as a list: refused before as not "a pair"
    return list(right(runs, repeat, clock))


@pytest.mark.parametrize("honest", [right, shared_readings, warm_up_timed_and_dropped, as_a_list])
def test_accepts_an_honest_harness(model, capsys, honest):
    assert ex07.check_benchmark(honest, model)
    assert capsys.readouterr().out.startswith("✓")


WRONG = {
    "one-off costs": make(warm=False),
    "favours whichever engine ran first": make(interleave=False),
    "then the next engine's": warms_each_then_times_it,
    "pulls the mean along": make(stat=statistics.fmean),
    "luckiest": make(stat=min),
    "no single run was timed on its own": make(per_run=False),
    "a later run only": make(every_run=False),
    "never read the clock": make(use_clock=False),
    "exactly repeat times": lambda runs, repeat, clock: make()(runs, repeat - 1, clock),
    "the total": make(stat=sum),
    "not the upper of them": make(stat=lambda t: sorted(t)[len(t) // 2]),  # (passed while every repeat was odd)
    "not the lower of them": make(stat=lambda t: sorted(t)[(len(t) - 1) // 2]),
    "not milliseconds": make(stat=lambda t: 1000 * statistics.median(t)),
    "is negative: a run's time is the clock after it minus the clock before it":
        make(stat=lambda t: -statistics.median(t)),  # (start - end; was "not the median of the runs")
    "the middle of the times sorted": make(stat=lambda t: t[len(t) // 2]),  # (passed while the runs only slowed)
    "not by duration": make(stat=lambda t: t[len(t) // 2] if len(t) % 2 else (t[len(t) // 2 - 1] + t[len(t) // 2]) / 2),
    "compare the tokens of every run": last_comparison_only,  # (passed while the buggy engine ran last)
    "a bug can show on a later run only (state left over)": last_round_only,
    "counts the runs before it in its round": one_reading_a_round,  # (was told "exactly repeat times")  # (passed while the stale bug lasted to the end)
}


@pytest.mark.parametrize("hint", list(WRONG))
def test_each_shortcut_fails_with_its_hint_and_never_the_medians(model, capsys, hint):
    assert not ex07.check_benchmark(WRONG[hint], model)
    out = capsys.readouterr().out
    assert out.startswith("✗") and hint in out, out
    clock = ex07.Clock()
    medians, _ = right(ex07.engine_runs(model, clock), 3, clock)
    assert not any(f"{m:.2f}" in out for m in medians.values())


def test_a_harness_that_always_says_same_tokens_fails(model, capsys):
    def always_same(runs, repeat, clock):
        return right(runs, repeat, clock)[0], True
    assert not ex07.check_benchmark(always_same, model)
    assert "compare the tokens of every run" in capsys.readouterr().out


def test_a_harness_that_compares_each_engine_with_itself_fails(model, capsys):
    """Each engine's runs against its own warm-up: right for an engine that goes wrong later, blind to one that is
    wrong from the start -- the case the check lacked."""
    def self_compare(runs, repeat, clock):
        firsts = {name: run() for name, run in runs.items()}
        times, same = {name: [] for name in runs}, True
        for _ in range(repeat):
            for name, run in runs.items():
                start = clock()
                out = run()
                times[name].append(clock() - start)
                same = same and out == firsts[name]
        return {n: statistics.median(t) for n, t in times.items()}, same

    assert not ex07.check_benchmark(self_compare, model)
    assert "not each engine with its own first run" in capsys.readouterr().out
    runs = ex07.engine_runs(model, ex07.Clock(), wrong=True)
    assert runs["paged (wrong tokens)"]() != runs["static"]()  # wrong on its first run already


def test_bad_answers_are_explained(model, capsys):
    assert not ex07.check_benchmark(right(ex07.engine_runs(model, ex07.Clock()), 1, ex07.Clock()), model)
    assert "function itself" in capsys.readouterr().out
    assert not ex07.check_benchmark(lambda runs, repeat, clock: None, model)
    assert "not done yet" in capsys.readouterr().out
    assert not ex07.check_benchmark(lambda runs, repeat, clock: 1 / 0, model)
    assert "ZeroDivisionError" in capsys.readouterr().out
    assert not ex07.check_benchmark(lambda runs, repeat, clock: ({"static": 1.0}, "yes"), model)
    assert "pair" in capsys.readouterr().out


def test_the_goodput_figure_draws_each_draws_own_arrival_rate():
    """Notebook 07, section 4: a Poisson draw arrives faster or slower than its nominal load, so the line no
    goodput can pass is the draw's own arrival rate, one per point."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cbteach.viz import bench as vb

    points = [{"workload": {"params": {"rate": r}}, "engines": {"cbteach_paged": {"goodput": r / 2}}} for r in (0.1, 0.2)]
    ax = vb.plot_goodput(points, unit="steps", arrived=[0.13, 0.27])
    line = next(ln for ln in ax.get_lines() if ln.get_label() == "arrival rate of the draw")
    assert list(line.get_ydata()) == [0.13, 0.27] and ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
    with pytest.raises(ValueError, match="one rate per point"):
        vb.plot_goodput(points, arrived=[0.1])
    plt.close("all")
