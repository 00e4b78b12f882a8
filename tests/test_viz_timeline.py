"""Slot timelines: zooming with ``steps=``, telling successive requests in a slot apart, and drawing
idle cells as what they cost (static: a throw-away token computed; continuous: nothing)."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402

from cbteach import Engine, Request, static_batching  # noqa: E402
from cbteach.core.records import SeqStep, StepRecord  # noqa: E402
from cbteach.viz import plot_timeline, plot_timelines, waste_breakdown  # noqa: E402
from cbteach.viz.style import STATE_COLORS  # noqa: E402
from conftest import tiny_model  # noqa: E402

# Forced lengths: static waves [r0 r1] (5 steps, r1 idles 3) and [r2 r3] (9 steps, r3 idles 6);
# continuous with 2 slots: r1 -> r2 in slot 1 on step 2, r0 -> r3 in slot 0 on step 5.
PROMPTS, OUTPUTS = [3, 12, 2, 4], [5, 2, 9, 3]


def _requests():
    return [Request([7 + i] * p, n, request_id=f"r{i}", ignore_eos=True)
            for i, (p, n) in enumerate(zip(PROMPTS, OUTPUTS))]


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


@pytest.fixture(scope="module")
def run():
    model = tiny_model("llama")
    eng = Engine(model, max_batch_size=2)
    eng.run(_requests())
    return {"static": static_batching(model, None, _requests(), 2), "records": eng.records}


def bars(ax, state):
    """The bars drawn in ``state``'s colour or its darker shade (by facecolour family)."""
    return [p for p in ax.patches if p.get_facecolor() == to_rgba(STATE_COLORS[state])]


def legend_text(ax):
    return " ".join(t.get_text() for t in ax.get_legend().get_texts()).replace("\n", " ")


def test_the_runs_are_as_planned(run):
    assert [st.wave for st in run["static"].steps] == [0] * 5 + [1] * 9
    slots = {(s.request_id, s.slot) for r in run["records"] for s in r.seqs}
    assert slots == {("r0", 0), ("r1", 1), ("r2", 1), ("r3", 0)}


def test_zoom_draws_and_counts_only_its_steps(run):
    st = run["static"]
    ax = plot_timeline(st, steps=(3, 8))
    assert ax.get_xlim() == (3, 8)
    assert ax.get_title().startswith("Static batching, steps 3-7")
    w = waste_breakdown(st, steps=(3, 8))
    assert w["slot_steps"] == 5 * 2 and f"{w['wasted_fraction']:.0%}" in ax.get_title()
    # steps 3-4: r1 idles; step 5: wave 1's prefill; steps 6-7: both decode
    assert (w["idle"], w["prefill"], w["decode"], w["empty"]) == (2, 2, 6, 0)
    assert all(p.get_x() >= 3 and p.get_x() + p.get_width() <= 8 for p in ax.patches)
    assert ax.get_xlabel() == "step" and ax.get_ylabel() == "slot"


def test_windows_partition_the_run(run):
    for source, n in ((run["static"], len(run["static"].steps)), (run["records"], len(run["records"]))):
        whole = waste_breakdown(source, 2)
        assert waste_breakdown(source, 2, steps=(0, n + 50)) == whole  # stop is clipped to the run
        parts = [waste_breakdown(source, 2, steps=(a, b)) for a, b in ((0, 4), (4, 7), (7, n))]
        for key in ("prefill", "decode", "idle", "empty", "slot_steps"):
            assert sum(p[key] for p in parts) == whole[key]
        assert sum(p["padding"] for p in parts) == pytest.approx(whole["padding"])


@pytest.mark.parametrize("steps, words", [((5, 5), "start < stop"), ((-1, 3), "start < stop"), ((2,), "pair"),
                                          ((1.0, 3), "whole numbers"), ((99, 100), "after the run's last step"),
                                          (7, "pair")])
def test_bad_windows_are_refused(run, steps, words):
    with pytest.raises(ValueError, match=words):
        plot_timeline(run["static"], steps=steps)


def test_static_idle_is_hatched_continuous_idle_is_not(run):
    ax = plot_timeline(run["static"])
    idle = bars(ax, "idle")
    assert idle and all(p.get_hatch() for p in idle)
    assert sum(p.get_width() for p in idle) == waste_breakdown(run["static"])["idle"] == 3 + 6
    assert "throw-away" in legend_text(ax) and "nothing computed" in legend_text(ax)

    def seq(rid, slot, kind="decode"):
        return SeqStep(rid, slot, kind, 3, 1, [1])
    records = [StepRecord(0, "concat", [seq("a", 0, "prefill"), seq("b", 1, "prefill")], admitted=["a", "b"]),
               StepRecord(1, "concat", [seq("a", 0)]),  # b holds slot 1 but is not scheduled: idle
               StepRecord(2, "concat", [seq("a", 0), seq("b", 1)], finished=["a", "b"])]
    ax = plot_timeline(records, 2)
    idle = bars(ax, "idle")
    assert len(idle) == 1 and not idle[0].get_hatch()
    text = legend_text(ax)
    assert "no compute" in text and "padding" not in text and "barrier" not in text


def test_successive_requests_in_a_slot_are_told_apart(run):
    fig = plot_timelines(run["static"], run["records"], 2)
    bottom = fig.axes[1]
    decode = [p for p in bottom.patches if p.get_y() < 1 < p.get_y() + p.get_height()]  # slot 1's bars
    r1, r2 = [p for p in decode if p.get_facecolor() != to_rgba(STATE_COLORS["prefill"])
              and p.get_x() < 2], [p for p in decode if p.get_x() >= 3]
    assert r1 and r2 and r1[0].get_facecolor() != r2[0].get_facecolor()  # two shades of decode blue
    seps = [seg for c in bottom.collections for seg in c.get_segments()]
    assert any(s[0][0] == 2 and s[0][1] < 1 < s[1][1] for s in seps)  # a separator where r2 takes slot 1
    assert any(s[0][0] == 5 and s[0][1] < 0 < s[1][1] for s in seps)  # ... and where r3 takes slot 0
    for ax in fig.axes[:2]:
        assert ax.get_legend() is not None and "next request" in legend_text(ax)


def test_ids_are_written_where_they_fit_and_shortened_where_not(run):
    fig = plot_timelines(run["static"], run["records"], 2)
    labels = [t.get_text() for t in fig.axes[1].texts]
    assert sorted(labels) == ["r0", "r1", "r2", "r3"]  # each request once
    rid = "VERY-LONG-HEADWORD"
    records = [StepRecord(i, "concat", [SeqStep(rid, 0, "prefill" if i == 0 else "decode", i, 1, [1])],
                          finished=[rid] if i == 2 else []) for i in range(3)]
    records += [StepRecord(i, "concat", [SeqStep("B", 0, "decode", i, 1, [1])]) for i in range(3, 60)]
    ax = plot_timeline(records, 1)
    assert [t.get_text() for t in ax.texts] == ["VER…", "B"]


def test_static_barriers_are_marked(run):
    st = run["static"]
    ax = plot_timeline(st)
    starts = [line.get_xdata()[0] for line in ax.lines]
    assert starts == [5]  # wave 1 starts on step 5
    assert "batch barrier" in legend_text(ax)
    assert len(plot_timeline(st, steps=(6, 10)).lines) == 0  # not in the window
