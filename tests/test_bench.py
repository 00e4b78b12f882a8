"""The benchmark tools, run small: shapes of what they write and the slot arithmetic they report.

Nothing here is timed or compared against a speed: timings belong to ``make bench`` and
``make gpu-check``, whose targets are printed as met / not met, never asserted. What is asserted:
every engine runs, writes every metric, honours arrival times and gives the same tokens.
"""
import importlib.util
import json
import math
from pathlib import Path

import pytest

from cbteach import Engine, Request, static_batching
from cbteach.serving import workloads as wl
from cbteach.bench.cli import cli
from cbteach.bench.measure import (ALL_ENGINES, ENGINES, compare, ideal_speedup, run_engine, slot_steps,
                                   targets)
from cbteach.bierce.corpus import headword_prompts

ROOT = Path(__file__).resolve().parents[1]


# -- pure helpers --------------------------------------------------------------------------------
def test_ideal_speedup_is_static_steps_over_continuous_steps():
    assert ideal_speedup(300, 100) == 3.0
    assert ideal_speedup(50, 50) == 1.0
    assert math.isnan(ideal_speedup(10, 0))


def test_slot_steps_on_hand_made_lengths():
    # waves [10, 1] and [1, 1]: static runs 10 + 1 steps; continuous needs the longest output, 10
    assert slot_steps([10, 1, 1, 1], 2) == {"static": 11, "continuous": 10, "ideal_speedup": 1.1}
    # equal lengths: nothing to gain
    assert slot_steps([5, 5, 5, 5], 2) == {"static": 10, "continuous": 10, "ideal_speedup": 1.0}
    # many short requests behind one long one: static waits 4 times for a wave's longest
    got = slot_steps([8, 2, 8, 2, 8, 2, 8, 2], 2)
    assert got["static"] == 32 and got["continuous"] == 20 and got["ideal_speedup"] == 1.6
    assert slot_steps([7], 4) == {"static": 7, "continuous": 7, "ideal_speedup": 1.0}


def test_targets_on_hand_made_rows():
    rows = {"static": {"seconds": 10.0, "steps": 100, "tokens_per_s": 100.0},
            "cbteach_paged": {"seconds": 6.0, "steps": 50, "tokens_per_s": 300.0},
            "transformers_cb": {"seconds": 5.0, "steps": None, "tokens_per_s": 250.0}}
    t = targets(rows)
    ideal = t["paged_vs_ideal"]
    assert ideal["ideal_speedup"] == 2.0 and ideal["measured_speedup"] == pytest.approx(10 / 6)
    assert ideal["value"] == pytest.approx(10 / 12) and ideal["met"] is False  # 0.83 < 0.9
    assert t["paged_vs_transformers_cb"]["value"] == pytest.approx(1.2) and t["paged_vs_transformers_cb"]["met"] is False
    rows["cbteach_paged"].update(seconds=5.0, tokens_per_s=400.0)
    t = targets(rows)
    assert t["paged_vs_ideal"]["met"] is True and t["paged_vs_transformers_cb"]["met"] is True
    # an engine that failed or did not run: the target is not measured, not failed
    t = targets({"static": rows["static"], "cbteach_paged": rows["cbteach_paged"], "transformers_cb": {"error": "x"}})
    assert t["paged_vs_transformers_cb"]["met"] is None and t["paged_vs_ideal"]["met"] is True


def test_slot_arithmetic_predicts_the_engines_step_counts(bierce):
    model, tok = bierce
    reqs = lambda: [Request(p, 20) for p in headword_prompts(6)]  # noqa: E731
    res = static_batching(model, tok, reqs(), 3)
    lengths = [len(c.output_ids) for c in res]
    predicted = slot_steps(lengths, 3)
    assert len(res.steps) == predicted["static"]  # exactly: one step per token of each wave's longest
    eng = Engine(model, tok, max_batch_size=3, kv="paged")
    eng.run(reqs())
    assert len(eng.records) >= predicted["continuous"]  # a lower bound: a freed slot refills a step later


# -- the commands, small -----------------------------------------------------------------------
METRIC_KEYS = {"tokens_per_s", "requests_per_s", "goodput", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99",
               "itl_p50", "itl_p99", "e2e_p50", "e2e_p99", "ttft_mean", "e2e_p90", "seconds", "matched"}


def test_bench_small_run_writes_every_engine(tmp_path, bierce):
    path = tmp_path / "bench.json"
    assert cli(["--requests", "4", "--max-batch-size", "2", "--max-new-tokens", "8", "--history", "6",
                "--json", str(path), "--no-progress"]) == 0
    data = json.loads(path.read_text())
    assert {"engines", "workload", "machine", "config", "targets"} <= set(data)
    rows = data["engines"]
    assert list(rows) == list(ALL_ENGINES)
    for name, row in rows.items():
        assert "error" not in row, row
        assert METRIC_KEYS <= set(row), METRIC_KEYS - set(row)
        assert row["matched"] is True, name  # greedy fp32: every engine gives per-prompt generate's tokens
        assert row["reference_engine"] == "hf_generate"
        assert row["tokens"] > 0 and row["tokens_per_s"] > 0 and row["seconds"] > 0 and row["first_run_seconds"] > 0
        assert row["num_completed"] == 4 and 0 < row["ttft_p50"] <= row["ttft_p99"] <= row["e2e_p99"]
    assert all(rows[n]["steps"] > 0 for n in ALL_ENGINES if n != "transformers_cb")
    assert rows["transformers_cb"]["steps"] is None  # not counted for transformers
    assert rows["hf_generate"]["steps"] == rows["hf_generate"]["tokens"]  # one request at a time
    assert rows["hf_batch_generate"]["steps"] == rows["static"]["steps"]  # the same waves
    assert rows["cbteach_concat"]["identical_to_static"] and rows["cbteach_paged"]["identical_to_static"]
    for name in ("cbteach_paged", "cbteach_paged_budget", "cbteach_paged_async"):
        assert 0 < rows[name]["paged_utilisation"] <= 1 and rows[name]["preemptions"] == 0
        assert rows[name]["peak_batch"] == 2
    assert data["workload"]["name"] == "headwords" and data["workload"]["num_requests"] == 4
    assert data["machine"]["device"] == "cpu" and data["machine"]["torch_threads"] == 1
    assert set(data["targets"]) == {"paged_vs_ideal", "paged_vs_transformers_cb", "paged_vs_static",
                                    "async_host_fraction"}
    assert 0 <= rows["cbteach_paged_async"]["host_fraction"] < 1 and rows["cbteach_paged_async"]["matched"]
    assert data["targets"]["async_host_fraction"]["met"] is (rows["cbteach_paged_async"]["host_fraction"] <= 0.05)
    assert all(t["met"] in (True, False) for t in data["targets"].values())
    sh = data["step_time_vs_history"]
    assert min(sh["concat"]["kv_bytes_copied"]) > 0 and min(sh["paged"]["kv_bytes_read"]) > 0
    assert max(sh["paged"]["kv_bytes_copied"]) == 0 and max(sh["concat"]["kv_bytes_read"]) == 0


def test_every_engine_honours_arrival_times(bierce):
    model, tok = bierce
    work = wl.with_poisson_arrivals(wl.length_variance(tok, 5, cap=6, mean=4.0, prompt_len=6), rate=40.0)
    got = {}
    rows = compare(model, tok, work, 2, ("hf_batch_generate", "static", "cbteach_paged", "transformers_cb"),
                   full_warmup=(), outputs=got, ttft_target=10.0, tpot_target=10.0)
    for name, comps in got.items():
        assert "error" not in rows[name], rows[name]
        assert [c.arrival_time for c in comps][1:] == pytest.approx(work.arrival_times[1:], abs=0.05), name
        assert all(c.first_token_time > c.arrival_time for c in comps), name
        assert [len(c.output_ids) for c in comps] == list(work.max_new_tokens)  # ignore_eos: exact lengths
        assert rows[name]["matched"] is True and rows[name]["reference_engine"] == "static"
        assert rows[name]["num_good"] == 5 and rows[name]["goodput"] == rows[name]["requests_per_s"]


def test_a_kv_budget_caps_the_batch(bierce):
    model, tok = bierce
    work = wl.length_variance(tok, 6, cap=12, mean=12.0, prompt_len=8)
    roomy, _ = run_engine("cbteach_paged", model, tok, work, 6)
    tight, comps = run_engine("cbteach_paged", model, tok, work, 6, kv_memory_bytes=3 * 16 * 2048)
    assert roomy["peak_batch"] == 6 and tight["num_blocks"] == 3 and tight["peak_batch"] < 6
    assert [len(c.output_ids) for c in comps] == list(work.max_new_tokens)
    with pytest.raises(ValueError, match="unknown engine"):
        run_engine("vllm", model, tok, work, 2)


def test_gpu_check_small_on_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    out = tmp_path / "gpu.json"
    code = gpu_check.main(["--small", "--skip-notebooks", "--out", str(out)])
    data = json.loads(out.read_text())
    assert code == 0 and "errors" not in data, data.get("errors")
    assert isinstance(data["device"], str) and data["device"]
    assert data["notebooks"] == {} and data["notebooks_skipped"]
    assert set(data["exact_fp32"]) == {"static", "concat", "paged", "paged_budget32", "paged_async"}
    for mode, (equal, total) in data["exact_fp32"].items():
        assert total > 0 and equal == total, mode
    assert set(data["throughput"]) == {"bierce", "llama_1b"}
    for workload, rows in data["throughput"].items():
        assert set(rows) == set(ENGINES), workload
        assert all(isinstance(v, float) and v > 0 for v in rows.values()), rows
        first = data["first_run_seconds"][workload]
        assert set(first) >= {"cbteach_concat", "cbteach_paged"}
        assert all(len(pair) == 2 and min(pair) > 0 for pair in first.values())


def test_bench_figures_draw_hand_made_rows():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cbteach.viz import bench as vb

    def row(tps, steps, ms):
        return {"tokens_per_s": tps, "steps": steps, "tokens": 10 * steps, "peak_batch": steps // 2,
                "goodput": tps / 100, **{f"{m}_{p}": ms * k / 1e3 for m in ("ttft", "tpot", "e2e")
                                         for p, k in (("p50", 1), ("p99", 3))}}

    rows = {"static": row(100.0, 20, 5.0), "cbteach_paged": row(150.0, 12, 4.0)}
    def point(key, v):
        return {"workload": {"params": {key: v}, "max_new_tokens": {"std": v / 2}}, "engines": rows}

    assert vb.ideal_from_point(point("cap", 8), 4) == pytest.approx(20 / 12)
    for fig in (vb.plot_engines(rows), vb.plot_variance([point("cap", c) for c in (2, 8)], batch_size=4),
                vb.plot_latency_vs_rate([point("rate", r) for r in (1.0, 2.0)], capacity={"static": 1.5}),
                vb.plot_memory({"contiguous": rows["static"], "paged": rows["cbteach_paged"]})):
        assert fig.axes and all(a.get_title() and a.get_xlabel() and a.get_ylabel() for a in fig.axes)
    for ax in (vb.plot_goodput([point("rate", r) for r in (1.0, 2.0)]), vb.plot_step_vs_batch([1, 2], [0.01, 0.012])):
        assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
    plt.close("all")
    # Input a figure cannot use is refused before any (blank) figure is made.
    caps, rates = [point("cap", c) for c in (2, 8)], [point("rate", r) for r in (1.0, 2.0)]
    for draw, match in [(lambda: vb.plot_variance([], batch_size=4), "length_variance sweep"),
                        (lambda: vb.plot_variance(rates, batch_size=4), "length_variance sweep"),
                        (lambda: vb.plot_goodput(caps), "poisson sweep"),
                        (lambda: vb.plot_latency_vs_rate([]), "poisson sweep"),
                        (lambda: vb.plot_engines({}), "no row to draw"),
                        (lambda: vb.plot_engines({"static": {"error": "boom"}}), "no row to draw"),
                        (lambda: vb.plot_memory({"paged": {**rows["static"], "steps": 0}}), "ran no steps"),
                        (lambda: vb.plot_memory({"paged": {"tokens_per_s": 1.0}}), "no row to draw"),
                        (lambda: vb.plot_step_vs_batch([], []), "one positive step time per batch size")]:
        with pytest.raises(ValueError, match=match):
            draw()
        assert not plt.get_fignums()


def test_latency_figures_refuse_rows_they_cannot_draw():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cbteach.viz import latency as lat

    with pytest.raises(ValueError, match="one row per token budget"):
        lat.plot_budget_tradeoff([{"budget": 8}])
    with pytest.raises(ValueError, match="every policy needs the same lanes"):
        lat.plot_lanes({"fcfs": {"hi": (0.1, 0.2)}, "priority": {"lo": (0.1, 0.2)}})
    assert not plt.get_fignums()


def test_targets_without_a_static_row_are_not_measured():
    """``bench --engines cbteach_paged`` alone: no static row to compare with, so nothing is measured
    (it used to divide by zero after the whole run)."""
    tg = targets({"cbteach_paged": {"steps": 40, "seconds": 1.0, "tokens_per_s": 100.0}})
    assert tg["paged_vs_ideal"]["met"] is None and tg["paged_vs_transformers_cb"]["met"] is None


def test_without_generate_or_static_the_tokens_are_still_checked(bierce):
    """``--engines cbteach_paged,cbteach_concat`` printed "same tokens as None" and ``matched: null``: exactness went
    unchecked. Per-prompt generate now runs once, untimed, as the reference."""
    model, tok = bierce
    rows = compare(model, tok, wl.build("headwords", tok, 3, max_new_tokens=6), 2, ("cbteach_paged", "cbteach_concat"),
                   full_warmup=())
    assert {r["reference_engine"] for r in rows.values()} == {"hf_generate (untimed)"}
    assert all(r["matched"] is True for r in rows.values()), rows
    assert list(rows) == ["cbteach_paged", "cbteach_concat"]  # (the reference is not a row)


def test_a_max_new_tokens_or_history_past_the_models_positions_is_an_argument_error(tmp_path, capsys):
    """Every engine then failed every request, after the history experiment ran and the results were written."""
    for flag in ("--max-new-tokens", "--history"):
        with pytest.raises(SystemExit) as e:
            cli([flag, "100000", "--requests", "2", "--engines", "cbteach_paged", "--json", str(tmp_path / "b.json")])
        assert e.value.code == 2 and f"{flag} 100000 leaves no room for a prompt" in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()


@pytest.mark.parametrize("argv, words", [
    (["--history", "1"], "give 0 (skip) or 2 or more"),  # ran everything, then: "no median for empty data"
    (["--max-batch-size", "70000"], "70,000 is more than 65,536"),  # engines FAILED in the table, exit 0
])
def test_values_the_run_would_fail_on_are_argument_errors(tmp_path, capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        cli([*argv, "--requests", "2", "--engines", "cbteach_paged", "--json", str(tmp_path / "b.json")])
    assert e.value.code == 2 and words in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()


@pytest.mark.parametrize("argv, words", [
    (["--workload", "headwords", "--cap", "5"], "headwords would ignore --cap (--cap is read by length_variance only)"),
    (["--workload", "chat", "--max-new-tokens", "5"], "chat would ignore --max-new-tokens"),
    (["--seed", "3"], "headwords would ignore --seed"),
    (["--workload", "length_variance", "--rate", "3"], "length_variance would ignore --rate"),
    (["--workload", "poisson", "--sweep", "4,8", "--rate", "3"], "--sweep sets --rate at each point"),
    (["--workload", "length_variance", "--sweep", "4,8", "--cap", "3"], "--sweep sets --cap at each point"),
    (["--engines", "static,cbteach_paged", "--token-budget", "5"], "--engines does not run that engine"),
])
def test_an_option_the_run_would_ignore_is_an_argument_error(tmp_path, capsys, argv, words):
    """``--cap 5`` with headwords, ``--rate`` beside a sweep of rates, a token budget for an engine not run: each ran
    and measured without it, saying nothing."""
    with pytest.raises(SystemExit) as e:
        cli([*argv, "--requests", "2", "--json", str(tmp_path / "b.json")])
    assert e.value.code == 2 and words in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()


@pytest.mark.parametrize("argv", [["--rate", "1e-300"], ["--sweep", "1e-300,5"], ["--rate", "0.0001"]])
def test_a_poisson_rate_the_run_would_wait_hours_for_is_an_argument_error(tmp_path, capsys, argv):
    """--rate 1e-300 failed inside the engines (an OverflowError, exit 1); a rate of 0.01 waited in real time with no
    output."""
    with pytest.raises(SystemExit) as e:
        cli(["--workload", "poisson", *argv, "--requests", "4", "--engines", "cbteach_paged",
             "--json", str(tmp_path / "b.json")])
    assert e.value.code == 2 and "which the benchmark waits out" in capsys.readouterr().err
