"""The simulator (cbteach.sim): the engine's own scheduler on a cost model, validated and used.

The first test is the one the rest stand on: with the same step time, a simulated run and the real
engine (a real model, the engine's clock simulated) take the same steps and give every request the
same TTFT and TPOT -- the simulator *is* the engine's scheduler, only the forward pass is replaced.
"""
import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import sim_clock, tiny_model

from cbteach import Engine
from cbteach.core.request import Request
from cbteach.sim import CostModel, get_device, get_model, shape_from_config, simulate, synthetic_workload
from cbteach.sim.capacity import Deployment, cost_per_million_tokens, gpus_for_users, max_rate, meets
from cbteach.sim.static import compare_batching, simulate_static
from cbteach.sim.validate import fit_cpu, load, predict_run, validation_report


@pytest.mark.parametrize("budget, num_blocks", [(None, 64), (8, 64), (None, 9)])  # plain, chunked, preempting
def test_simulated_run_is_the_engines_schedule(budget, num_blocks):
    model = tiny_model("llama")
    workload = synthetic_workload(10, 40.0, (3, 20), (2, 12), seed=3)
    eng = Engine(model, None, max_batch_size=4, kv="paged", block_size=4, num_blocks=num_blocks, token_budget=budget,
                 clock=sim_clock(0.01))
    reqs = [Request([7] * r.prompt_len, r.output_len, request_id=r.request_id, arrival_time=r.arrival_time,
                    ignore_eos=True) for r in workload]
    comps = eng.run(reqs)
    sim = simulate(workload, lambda plan: 0.01, max_batch_size=4, num_blocks=num_blocks, block_size=4,
                   token_budget=budget)
    engine_steps = [r.num_tokens for r in eng.records if r.seqs]
    assert sim.step_tokens == engine_steps
    assert sim.ttft == pytest.approx([c.first_token_time - c.arrival_time for c in comps], abs=1e-9)
    assert sim.e2e == pytest.approx([c.token_times[-1] - c.arrival_time for c in comps], abs=1e-9)
    if num_blocks == 9:
        assert sim.num_preemptions > 0  # the small pool did preempt, in both


def test_model_shapes_from_configs():
    assert get_model("llama-3-8b").num_params == pytest.approx(8.03e9, rel=0.01)
    assert get_model("llama-3-70b").num_params == pytest.approx(70.6e9, rel=0.01)
    assert get_model("qwen2.5-7b").num_params == pytest.approx(7.6e9, rel=0.02)
    assert get_model("opt-13b").num_params == pytest.approx(12.85e9, rel=0.01)
    for arch in ("llama", "qwen2", "gpt2"):  # read as the engine reads a model
        from cbteach.core.modelinfo import describe

        model = tiny_model(arch)
        shape, info = shape_from_config(model.config), describe(model)
        assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (info.num_layers, info.num_kv_heads,
                                                                          info.head_dim)
        weights = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "wpe" not in n)
        assert shape.num_params == pytest.approx(weights, rel=0.01)
    with pytest.raises(ValueError, match="unknown model"):
        get_model("gpt-5")
    with pytest.raises(ValueError, match="unknown device"):
        get_device("tpu-v9")


def test_roofline_sides_and_tensor_parallelism():
    one = CostModel("llama-3-8b", "a100-80gb")
    decode = one.step([1000] * 16, [1] * 16)
    prefill = one.step([0], [4096])
    assert decode.bound == "memory" and prefill.bound == "compute"
    assert decode.bytes > one.weight_bytes_per_device  # the weights, plus the K/V it reads
    two = CostModel("llama-3-8b", "a100-80gb", 2)
    d2 = two.step([1000] * 16, [1] * 16)
    assert two.weight_bytes_per_device == pytest.approx(one.weight_bytes_per_device / 2)
    assert d2.comm > 0 and decode.comm == 0
    assert d2.memory < decode.memory
    assert two.kv_capacity_tokens() > 2 * one.kv_capacity_tokens()  # half the weights each: more room left
    # the ring's wire bytes: 2 (N - 1) / N of the payload, per rank; latency per hop
    assert d2.comm_payload == 2 * 32 * 16 * 4096 * 2 and d2.comm_bytes == d2.comm_payload  # N = 2: equal
    four = CostModel("llama-3-8b", "a100-80gb", 4).step([1000] * 16, [1] * 16)
    assert four.comm_bytes == pytest.approx(1.5 * four.comm_payload)
    assert CostModel("llama-3-70b", "h100", 16).kv_bytes_per_token_per_device == \
        CostModel("llama-3-70b", "h100", 8).kv_bytes_per_token_per_device  # 8 KV heads: replicated past 8
    with pytest.raises(ValueError, match="does not fit"):
        CostModel("llama-3-70b", "a100-40gb").kv_capacity_tokens()
    with pytest.raises(ValueError, match="--tp 3: .*do not split"):
        CostModel("llama-3-8b", "h100", 3)


def test_memory_is_gib_and_vllms_budget():
    """An "80 GB" card is 80 GiB; vLLM's budget is 0.9 of it, less the weights, the profiled activations
    and the non-torch memory; Llama-3-70B at TP 2 holds its weights on H100s, with little K/V room."""
    h100 = get_device("h100")
    assert h100.memory_bytes == 80 * 2**30
    m = CostModel("llama-3-70b", "h100", 2).memory_budget()
    assert m["budget"] == pytest.approx(0.9 * 80 * 2**30)
    assert m["weights"] < m["budget"] and 0 < m["kv_cache"] < 0.1 * m["budget"]
    assert m["kv_cache"] == pytest.approx(m["budget"] - m["weights"] - m["activations"] - m["non_torch"])
    bigger = CostModel("llama-3-8b", "a100-80gb").memory_budget(max_num_batched_tokens=8192)
    assert bigger["activations"] > CostModel("llama-3-8b", "a100-80gb").memory_budget()["activations"]
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CostModel("llama-3-8b", "h100").memory_budget(1.5)


def test_all_reduce_latency_and_topology():
    """Ring all-reduce: 2 (N - 1) hops of latency, 2 (N - 1) / N of the payload on the wire; PCIe is slower."""
    nv = get_device("a100-80gb").with_(tp_gemm_exponent=0.0)
    cost = {n: CostModel("llama-3-8b", nv, n).step([100] * 8, [1] * 8) for n in (2, 4, 8)}
    for n, c in cost.items():
        expected = 2 * 32 * 2 * (n - 1) * nv.link_latency + c.comm_bytes / (nv.link_bandwidth * nv.link_efficiency)
        assert c.comm == pytest.approx(expected)
    assert cost[2].comm < cost[4].comm < cost[8].comm
    pcie = nv.with_(link="pcie", link_bandwidth=32e9, link_latency=5e-6)
    assert CostModel("llama-3-8b", pcie, 4).step([100] * 8, [1] * 8).comm > 2 * cost[4].comm


def test_common_random_numbers_across_rates():
    a, b = synthetic_workload(50, 1.0, seed=5), synthetic_workload(50, 4.0, seed=5)
    assert [r.prompt_len for r in a] == [r.prompt_len for r in b]
    assert [r.arrival_time / 4 for r in a] == pytest.approx([r.arrival_time for r in b])
    spread = synthetic_workload(400, None, (16, 16), (16, 1536), spread="loguniform")
    lens = [r.output_len for r in spread]
    assert min(lens) >= 16 and max(lens) <= 1536 and np.median(lens) < 400  # log-uniform: many short ones


def test_validation_on_held_out_runs():
    data = load()
    report = validation_report(data)
    held_out = [r["spec"]["name"] for r in data["runs"] if not r["spec"]["train"]]
    assert [p["run"] for p in report["held_out"]] == held_out and set(held_out).isdisjoint(report["train"])
    # Fitted on the training runs only: changing a held-out run's measurements changes nothing fitted.
    changed = json.loads(json.dumps(data))
    for run in changed["runs"]:
        if not run["spec"]["train"]:
            for step in run["steps"]:
                step["t"] *= 3
    assert validation_report(changed)["device"] == report["device"]
    for p in report["held_out"]:
        assert p["simulated_steps"] > 0 and all(math.isfinite(p[k]) for k in ("step_mape", "ttft_error", "tpot_error"))
    # The report is what the notebook and the README state (benchmarks/sim/results/validation.json).
    from pathlib import Path

    stored = json.loads((Path(__file__).parent.parent / "benchmarks/sim/results/validation.json").read_text())
    assert stored["worst"] == pytest.approx(report["worst"], rel=1e-6) and stored["mae"] == pytest.approx(report["mae"])


def test_fit_recovers_a_known_device():
    """A device that charges attention for the engine's padded groups (and a cost per group) is recovered
    by fit_cpu from its own step times."""
    truth = get_device("t4").with_(step_overhead=2e-3, seq_overhead=1e-4, dtype_bytes=4, mfu=1.0, mbu=1.0,
                                   attn_flops=5e12, attention_layout="groups", group_overhead=3e-4, overlap=False,
                                   mem_bandwidth=1e18, kv_bandwidth=2e10)
    cost = CostModel("bierce", truth)
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(300):
        s = int(rng.integers(1, 24))
        c = rng.integers(0, 2000, s).tolist()
        n = [1] * s if rng.random() < 0.6 else [int(x) if rng.random() < 0.5 else 1 for x in rng.integers(2, 400, s)]
        steps.append({"c": c, "n": n, "t": cost.step_time(c, n)})
    fitted = fit_cpu([{"spec": {"name": "synthetic"}, "steps": steps}])
    pred = CostModel("bierce", fitted)
    errors = [abs(pred.step_time(s["c"], s["n"]) - s["t"]) / s["t"] for s in steps]
    assert max(errors) < 0.03
    assert fitted.step_overhead == pytest.approx(2e-3, rel=0.1) and fitted.group_overhead == pytest.approx(3e-4, rel=0.2)
    assert fitted.attention_layout == "groups" and dict(fitted.calibrated_range)["seqs"] == max(len(s["n"]) for s in steps)


def test_fit_recovers_the_cost_of_scores_that_leave_the_cache():
    """Big padded prefill groups write score tensors past cost.SPILL_BYTES: a device that charges them their
    own bandwidth is recovered by fit_cpu (score_bandwidth within 10%), the charge is what the cost model
    adds for those steps only, and runs without such steps fit no score bandwidth (nothing charged)."""
    from cbteach.sim.cost import SPILL_BYTES

    truth = get_device("t4").with_(step_overhead=2e-3, seq_overhead=1e-4, dtype_bytes=4, mfu=1.0, mbu=1.0,
                                   attn_flops=5e12, attention_layout="groups", group_overhead=3e-4, overlap=False,
                                   mem_bandwidth=1e18, kv_bandwidth=2e10, score_bandwidth=4e9)
    cost = CostModel("bierce", truth)
    rng = np.random.default_rng(2)
    small, big = [], []
    for _ in range(200):
        s = int(rng.integers(1, 24))
        c = rng.integers(0, 2000, s).tolist()
        n = [1] * s if rng.random() < 0.6 else [int(x) if rng.random() < 0.5 else 1 for x in rng.integers(2, 400, s)]
        small.append({"c": c, "n": n, "t": cost.step_time(c, n)})
    for _ in range(40):
        n = rng.integers(1200, 2500, int(rng.integers(3, 6))).tolist()
        big.append({"c": [0] * len(n), "n": n, "t": cost.step_time([0] * len(n), n)})
    assert all(cost.step(s["c"], s["n"]).score_bytes > SPILL_BYTES for s in big)
    steps, small = small + big, [s for s in small if cost.step(s["c"], s["n"]).score_bytes == 0]
    assert len(small) > 100
    fitted = fit_cpu([{"spec": {"name": "synthetic"}, "steps": steps}])
    assert fitted.score_bandwidth == pytest.approx(4e9, rel=0.1)
    pred = CostModel("bierce", fitted)
    assert max(abs(pred.step_time(s["c"], s["n"]) - s["t"]) / s["t"] for s in steps) < 0.03
    assert fit_cpu([{"spec": {"name": "synthetic"}, "steps": small}]).score_bandwidth == 0.0
    uncharged = CostModel("bierce", truth.with_(score_bandwidth=0.0))
    for s in big[:5]:
        extra = cost.step(s["c"], s["n"]).score_bytes / 4e9
        assert cost.step_time(s["c"], s["n"]) == pytest.approx(uncharged.step_time(s["c"], s["n"]) + extra)


def test_charging_spilled_scores_fixes_the_prefill_heavy_run():
    """benchmarks/sim/spill_before_after.py's stored occasion (held-out runs and their covering sweep, measured
    together): fitted without the score term (charge_scores=False: the cost model before) the prefill-heavy
    run's TTFT, E2E and throughput are off by over 15%; fitted with it, under 6%, and the mean TTFT error
    drops. Pure arithmetic on stored measurements: deterministic."""
    data = json.loads((Path(__file__).parent.parent /
                       "benchmarks/sim/results/other_measurements/spill_paired_2026-12-05.json").read_text())
    after = validation_report(data["runs"], fit_cpu(data["grid"]))
    unfitted = fit_cpu(data["grid"], charge_scores=False)
    assert unfitted.score_bandwidth == 0.0 and after["device"].score_bandwidth > 0
    before = validation_report(data["runs"], unfitted)
    heavy = {name: next(p for p in rep["held_out"] if p["run"] == "prefill-heavy")
             for name, rep in (("before", before), ("after", after))}
    for metric in ("ttft_error", "e2e_error", "throughput_error"):
        assert heavy["before"][metric] > 0.15 and heavy["after"][metric] < 0.06, (metric, heavy)
    assert after["mae"]["ttft_error"] < before["mae"]["ttft_error"]


@pytest.mark.parametrize("bucket_shapes", [False, True])
def test_attention_work_is_what_the_engine_builds(bucket_shapes):
    """The cost model's "groups" ("buckets") layout charges, per layer and head, the keys and (query, key) pairs
    of the groups cbteach.attention.metadata.build makes for the same step -- padding included."""
    from cbteach.attention.metadata import build
    from cbteach.sim.attention_work import attention_work

    rng = np.random.default_rng(1)
    for _ in range(40):
        s = int(rng.integers(1, 12))
        c = rng.integers(0, 300, s).tolist()
        n = [1 if rng.random() < 0.6 else int(rng.integers(2, 90)) for _ in range(s)]
        tables, nxt = [], 1
        for ci, ni in zip(c, n):
            k = -(-(ci + ni) // 16)
            tables.append(list(range(nxt, nxt + k)))
            nxt += k
        meta = build([1] * sum(n), c, n, "cpu", block_tables=tables, block_size=16, bucket_shapes=bucket_shapes)
        work = attention_work(c, n, "buckets" if bucket_shapes else "groups", block_size=16)
        shapes = [tuple(g.mask.shape) for g in meta.groups]  # [G, 1, Q, K]
        assert work.groups == len(shapes)
        assert work.read == sum(g * k for g, _, _, k in shapes)
        assert work.pairs == sum(g * q * k for g, _, q, k in shapes)
        # Only the groups whose scores exceed the threshold count as spilled, each with all its pairs.
        limit = float(rng.integers(100, 20000))
        spilled = attention_work(c, n, "buckets" if bucket_shapes else "groups", block_size=16, spill_pairs=limit)
        assert spilled.spilled == sum(g * q * k for g, _, q, k in shapes if g * q * k > limit)
        assert (spilled.pairs, spilled.read, work.spilled) == (work.pairs, work.read, 0.0)
    exact = attention_work([10, 0], [1, 5], "exact")
    assert exact.pairs == 10 + 1 + 15 and exact.read == 11 + 5  # causal pairs; each context read once
    assert attention_work([0], [4000], "exact", spill_pairs=1.0).spilled == 0.0  # an exact kernel keeps scores on chip
    with pytest.raises(ValueError, match="attention layout"):
        attention_work([0], [1], "paged")


def test_calibration_grid_covers_the_workloads_shape():
    """A grid built from a workload's shape reaches its largest batch, step and context: the engine's own
    schedule of every grid point (the simulator's, with any step time) has no more than 5% of the
    workload's steps beyond its range -- for each held-out workload and for all of them together."""
    from cbteach.sim.calibrate import covering_grid, shape_of, _point
    from cbteach.sim.coverage import Coverage, range_of
    from cbteach.sim.measure import HELD_OUT, workload_of

    def steps_of(work, **engine):
        plans = []

        def record(plan):
            starts = plan.num_computed_tokens_of()
            plans.append({"c": [starts[r] for r in plan.num_scheduled_tokens],
                          "n": list(plan.num_scheduled_tokens.values())})
            return 0.01

        simulate(work, record, **engine)
        return plans

    runs = []
    for spec in HELD_OUT:
        engine = dict(max_batch_size=spec.max_batch_size, num_blocks=spec.num_blocks, token_budget=spec.token_budget)
        runs.append({"spec": {"token_budget": spec.token_budget}, "steps": steps_of(workload_of(spec), **engine),
                     "requests": [{"prompt_len": r.prompt_len, "n": r.output_len} for r in workload_of(spec)]})
    for group in [[r] for r in runs] + [runs]:
        shape = shape_of({"runs": group})
        grid_steps = []
        for k, point in enumerate(covering_grid(shape)):
            b, prompts, outputs, budget, spread = _point(point)
            work = synthetic_workload(b, None, prompts, outputs, seed=k, spread=spread)
            grid_steps += steps_of(work, max_batch_size=b, num_blocks=sum(r.prompt_len + r.output_len for r in work) // 16
                                   + b + 64, token_budget=budget)
        coverage = Coverage(range_of(grid_steps))
        for run in group:
            for step in run["steps"]:
                coverage.check(step["c"], step["n"])
        assert coverage.report()["fraction"] <= 0.05, (shape, coverage.report())


def test_capacity_search_is_monotone_in_targets_and_rate():
    dep = Deployment(num_requests=60, output_lens=(16, 128), prompt_lens=(64, 512), max_batch_size=32)
    rates = [max_rate(dep, ttft, tpot, bisections=3).rate for ttft, tpot in [(0.2, 0.02), (0.5, 0.03), (2.0, 0.1)]]
    assert 0 < rates[0] <= rates[1] <= rates[2]
    for r in [1, 2, 4, 8, 16, 32]:
        assert dep.run(r, 200).quantile("ttft", 0.9) <= dep.run(2 * r, 200).quantile("ttft", 0.9) + 1e-12
    assert [gpus_for_users(u, 0.05, rates[1], 2) for u in (1, 100, 1000, 5000)] == sorted(
        gpus_for_users(u, 0.05, rates[1], 2) for u in (1, 100, 1000, 5000))
    with pytest.raises(ValueError, match="TTFT target"):
        max_rate(dep, 0, 0.05)


def test_capacity_is_steady_state_within_the_roofline():
    """A capacity comes from a run at least 10x its concurrency, warm-up discarded; it never offers more
    than the device's compute or bandwidth roofline allows, and its cost is from the tokens served."""
    from cbteach.sim.capacity import check_within_roofline, stable

    dep = Deployment("llama-3-8b", "a100-80gb", num_requests=100, max_batch_size=32, output_lens=(16, 128))
    cap = max_rate(dep, 2.0, 0.08, bisections=3)
    st = cap.steady
    assert st["steady"] and st["requests"] >= 10 * st["concurrency"] and st["measured"] < st["requests"]
    assert stable(st)
    roof = dep.roofline()
    assert 0 < cap.rate <= roof["rate"] and st["served_tokens_per_s"] <= roof["output_tokens_per_s"]
    check_within_roofline(dep, cap.rate, st["served_tokens_per_s"])  # does not raise
    with pytest.raises(ValueError, match="roofline"):  # a rate no device could serve is refused
        check_within_roofline(dep, 1.01 * roof["rate"])
    with pytest.raises(ValueError, match="roofline"):
        check_within_roofline(dep, 1.0, 1.01 * roof["output_tokens_per_s"])
    # A short run at 1.5x the roofline still "meets" a loose TTFT target: the transient the search avoids.
    assert meets(dep.run(1.5 * roof["rate"], 100), 30.0, 1.0)
    _, steady = dep.steady_run(1.5 * roof["rate"])
    assert not stable(steady) and steady["requests"] > 100  # served less than arrived: the queue grows
    # Cost per token from what was served: price over served tokens per hour.
    price = get_device("a100-80gb").price_per_hour
    assert cost_per_million_tokens(dep, cap) == pytest.approx(price / (st["served_tokens_per_s"] * 3600) * 1e6)


def test_roofline_rate_is_the_work_of_a_request():
    from cbteach.sim.roofline import request_work, roofline_rate

    cost = CostModel("llama-3-8b", "a100-80gb")
    w = request_work(cost, [100], [1], 1)  # one prefill of 100 tokens, its first token
    shape = cost.shape
    dense = 2 * shape.num_layers * shape.layer_params * 100 + 2 * shape.hidden_size * shape.vocab_size
    assert w["flops"] == pytest.approx(dense + 4 * shape.num_layers * shape.num_heads * shape.head_dim * 5050)
    roof = roofline_rate(cost, [100], [1], 1)
    assert roof["compute"] == pytest.approx(312e12 / w["flops"]) and roof["rate"] <= roof["compute"]
    two = roofline_rate(CostModel("llama-3-8b", "a100-80gb", 2), [100], [1], 1)
    assert two["compute"] == pytest.approx(2 * roof["compute"])  # two devices, twice the FLOPs


def test_static_vs_continuous_factors():
    small = synthetic_workload(120, None, (64, 512), (16, 1536), seed=1, spread="loguniform")
    rep = compare_batching("opt-13b", "a100-40gb", small)
    f = rep["factors"]
    assert rep["total"] == pytest.approx(f["memory"] * f["padding"] * f["waiting"])
    assert f["memory"] > 1 and f["padding"] >= 1 and f["waiting"] > 1
    assert rep["batch_size_static"] < rep["batch_size_paged"]
    one = simulate_static(small[:3], CostModel("opt-13b", "a100-40gb"), 3)
    assert len(one.step_times) == max(r.output_len for r in small[:3])  # one prefill, then the longest decode


def test_cli(capsys):
    from cbteach.__main__ import main

    assert main(["simulate", "--json", "run", "--requests", "20", "--rate", "2", "--model", "qwen2.5-7b"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["simulated"] is True and out["requests"] == 20
    assert main(["simulate", "models"]) == 0 and "llama-3-70b" in capsys.readouterr().out
    assert main(["simulate", "run", "--device", "tpu"]) == 2 and "--device tpu" in capsys.readouterr().err
    capsys.readouterr()
    assert main(["simulate", "run", "--tp", "3"]) == 2  # an error names the flag the user typed
    err = capsys.readouterr().err
    assert "--tp 3" in err and "tensor_parallel_size" not in err
    for what in ("run", "capacity"):  # lengths past the model's positions: simulated before as if they could run
        assert main(["simulate", what, "--model", "opt-13b", "--prompt", "5000,5000", "--output", "3000,3000",
                     "--requests", "4"]) == 2
        assert "(5000 + 3000 = 8000 tokens) is more than opt-13b's 2048 positions" in capsys.readouterr().err
    assert main(["simulate", "capacity", "--model", "bierce", "--device", "t4", "--prompt", "8,16", "--output", "4,8",
                 "--requests", "40", "--batch", "4"]) == 0
    out = capsys.readouterr()
    assert "simulated runs" in out.err and "served_output_tokens_s" in out.out  # a progress bar; served tokens
    with pytest.raises(SystemExit):
        main(["simulate", "run", "--prompt", "9,3"])


def test_predict_run_replays_the_held_out_workload():
    data = load()
    device = fit_cpu([r for r in data["runs"] if r["spec"]["train"]])
    run = next(r for r in data["runs"] if not r["spec"]["train"])
    p = predict_run(run, device)
    assert p["simulated_steps"] == pytest.approx(p["steps"], rel=0.1)  # the same scheduler, nearly the same steps


def test_calibrate_writes_a_device_that_validate_reads(tmp_path, capsys):
    """`simulate calibrate` on a tiny grid: the real engine's steps, fitted, written as a device file that
    CostModel and `simulate validate --device` read; validate reports every metric's error, per run."""
    from cbteach.__main__ import main
    from cbteach.sim.calibrate import calibrate, load_device, save_device
    from cbteach.sim.validate import record_run

    model = tiny_model("llama")
    cal = calibrate(model, grid=[(1, 8, 4, None), (3, 12, 3, None), (2, 20, 2, 8)], repeats=1)
    info = cal["calibration"]
    assert info["steps"] >= 4 + 3 + 5 and info["clock"] == "wall"  # outputs 4, 3; the chunked prompt 5 chunks
    path = save_device(cal, tmp_path / "dev.json")
    assert load_device(path) == cal["device"] and get_device(str(path)) == cal["device"]
    # A run recorded by any Engine, in the format validate reads.
    eng = Engine(model, None, max_batch_size=2, kv="paged", block_size=4, num_blocks=32)
    comps = eng.run([Request([5] * 6, 3, request_id=0, ignore_eos=True), Request([6] * 9, 4, request_id=1,
                                                                                ignore_eos=True)])
    run = record_run(eng, comps, name="two", max_batch_size=2, num_blocks=32, block_size=4, token_budget=None)
    assert [r["n"] for r in run["requests"]] == [3, 4] and len(run["steps"]) == len([r for r in eng.records if r.seqs])
    data = tmp_path / "runs.json"
    data.write_text(json.dumps({"runs": [run]}))
    report = validation_report(json.loads(data.read_text()), cal["device"])
    assert set(report["mae"]) >= {"ttft_error", "tpot_error", "e2e_error", "throughput_error"}
    assert main(["simulate", "--json", "validate", "--device", str(path), "--data", str(data)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["held_out"][0]["run"] == "two" and out["mean_abs_error"]["ttft_error"] == pytest.approx(
        report["mae"]["ttft_error"])
    assert main(["simulate", "validate", "--device", str(tmp_path / "missing.json")]) == 2
    assert "not a device file" in capsys.readouterr().err


def test_validate_predicts_every_run_with_a_given_device():
    """With a device (fitted elsewhere), every run is held out; a device fitted on the same runs predicts
    them better than one from another occasion scaled 1.6x slower."""
    data = load()
    device = fit_cpu([r for r in data["runs"] if r["spec"]["train"]])
    rep = validation_report(data, device)
    assert [p["run"] for p in rep["held_out"]] == [r["spec"]["name"] for r in data["runs"]] and rep["train"] == []
    slower = device.with_(step_overhead=1.6 * device.step_overhead, seq_overhead=1.6 * device.seq_overhead,
                          peak_flops=device.peak_flops / 1.6, attn_flops=device.attn_flops / 1.6,
                          kv_bandwidth=device.kv_bandwidth / 1.6)
    assert validation_report(data, slower)["mae"]["tpot_error"] > rep["mae"]["tpot_error"]


def test_published_table_is_what_the_code_computes():
    """benchmarks/sim/results/published_runs.md is the table benchmarks/sim/published.py writes now, and
    every row names a source the data file lists."""
    import importlib.util
    from pathlib import Path

    from cbteach.sim.published import compare
    from cbteach.sim.published import load as load_published

    root = Path(__file__).parent.parent
    spec = importlib.util.spec_from_file_location("published_bench", root / "benchmarks/sim/published.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert (root / "benchmarks/sim/results/published_runs.md").read_text() == bench.table()
    data = load_published()
    assert all(r["source"] in data["sources"] for r in data["rows"])
    rows = compare(data)
    assert all(r["predicted"] > 0 and r["ratio"] == pytest.approx(r["predicted"] / r["published"]) for r in rows)


def test_a_calibration_predicts_the_runs_of_its_own_occasion_within_25_percent():
    """Issue 39's target on kept measurements: `simulate calibrate` and `measure_cpu.py` run one after the
    other on the quiet 2-core machine (benchmarks/sim/results/calibrated_same_occasion/); the device file
    predicts every run -- none of them part of its calibration grid -- with a mean absolute error under 25%
    on TTFT, TPOT, E2E and throughput. Pure simulation of stored numbers: it fails if the simulator changes
    what it predicts, never because of this machine's speed."""
    from pathlib import Path

    from cbteach.sim.calibrate import load_device

    folder = Path(__file__).parent.parent / "benchmarks/sim/results/calibrated_same_occasion"
    report = validation_report(json.loads((folder / "runs.json").read_text()), load_device(folder / "device.json"))
    assert report["train"] == [] and len(report["held_out"]) == 7
    for metric in ("ttft_error", "tpot_error", "e2e_error", "throughput_error"):
        assert report["mae"][metric] < 0.25, (metric, report["mae"])
    # The stored report and the README's figures are this report's.
    text = (folder / "validation.txt").read_text()
    for metric in ("ttft_error", "tpot_error", "e2e_error", "throughput_error"):
        assert f"{metric}: {report['mae'][metric]:.4g}" in text
    mae = report["mae"]
    readme = (folder.parent.parent / "README.md").read_text()
    assert (f"TTFT {mae['ttft_error']:.1%}, TPOT {mae['tpot_error']:.1%}, E2E {mae['e2e_error']:.1%}, "
            f"throughput {mae['throughput_error']:.1%}") in " ".join(readme.split())


def test_capacity_holds_over_a_run_four_times_longer():
    """Issue 46: the rate `simulate capacity` answers is sustained -- a run at least 4x as long as the one that
    found it still meets both targets, serves what is offered and has no growing queue -- for a tight and a
    relaxed pair of targets; and the rate the search rejected above it did fail. Pure simulation:
    deterministic on any machine. The deployment is notebook 13's with shorter answers and a smaller batch
    (seconds, not minutes); notebook 13's own two searches run under nbval, which compares their printed
    rates and stability tests with the stored ones."""
    from cbteach.sim.capacity import stable

    dep = Deployment("llama-3-8b", "a100-80gb", prompt_lens=(128, 1024), output_lens=(16, 128), max_batch_size=32)
    for ttft, tpot, bisections in [(0.5, 0.03, 3), (2.0, 0.08, 3)]:
        cap = max_rate(dep, ttft, tpot, bisections=bisections)
        assert cap.rate > 0 and cap.steady["requests"] >= 4 * cap.first["requests"]
        _, st = dep.steady_run(cap.rate, min_requests=4 * cap.first["requests"])
        assert st["steady"] and meets(st, ttft, tpot) and stable(st), (ttft, tpot, st)
        assert st["served_tokens_per_s"] >= 0.9 * st["offered_tokens_per_s"]
        assert st["queue_last"] <= 1.5 * st["queue_first"] + 1
        rejected = [p for p in cap.probes if p[0] > cap.rate and not p[3]]
        assert rejected, "the search found no failing rate above its answer"
        assert f"{cap.steady['requests']:,}" in cap.test and f"{cap.first['requests']:,}" in cap.test


def test_validate_warns_when_the_calibration_belongs_elsewhere(tmp_path, capsys):
    """`simulate validate` says when the device file was calibrated on another machine, torch, thread count or
    load than the runs, and when too many of the runs' steps lie outside its calibrated range; a calibration of
    the runs' own occasion gets no warning."""
    from cbteach.__main__ import main
    from cbteach.sim.calibrate import load_device, save_device
    from cbteach.sim.occasion import occasion_warnings

    folder = Path(__file__).parent.parent / "benchmarks/sim/results/calibrated_same_occasion"
    runs = json.loads((folder / "runs.json").read_text())
    device = load_device(folder / "device.json")  # calibrated beside these runs
    here = dict(runs["machine"], load_before=runs["load_before"][0], when="2026-12-03 23:30:00 UTC")
    elsewhere = dict(here, platform="Linux-other", torch="2.0.0", torch_threads=4, load_before=3.0,
                     when="2026-11-01 10:00:00 UTC")
    assert occasion_warnings(here, here) == []
    said = " ".join(occasion_warnings(elsewhere, here))
    for word in ("operating system", "torch version", "torch threads", "load", "another occasion"):
        assert word in said, word
    runs_file = tmp_path / "runs.json"
    runs_file.write_text(json.dumps(runs))
    for calibration, device_used, expect in [(here, device, []), (elsewhere, device, ["torch threads"]),
                                             (here, device.with_(calibrated_range=(("seqs", 2.0), ("tokens", 64.0),
                                                                                    ("context", 64.0))),
                                              ["outside the calibrated range"])]:
        path = save_device({"device": device_used, "calibration": calibration}, tmp_path / "dev.json")
        assert main(["simulate", "--json", "validate", "--device", str(path), "--data", str(runs_file)]) == 0
        out = json.loads(capsys.readouterr().out)
        warnings = " ".join(out.get("warnings", []))
        assert all(e in warnings for e in expect) and (warnings == "") == (expect == []), warnings
    # The same machine, torch and load on paper, but every step 25% slower than during the sweep (a slow spell
    # of a shared machine that no load figure shows): the runs themselves say so.
    for scale, how in [(1.25, "more time"), (0.8, "less time")]:
        slow = json.loads(json.dumps(runs))
        for run in slow["runs"]:
            for step in run["steps"]:
                step["t"] *= scale
        runs_file.write_text(json.dumps(slow))
        path = save_device({"device": device, "calibration": here}, tmp_path / "dev.json")
        assert main(["simulate", "--json", "validate", "--device", str(path), "--data", str(runs_file)]) == 0
        warnings = json.loads(capsys.readouterr().out).get("warnings", [])
        assert len(warnings) == 1 and how in warnings[0] and "speed differed" in warnings[0], warnings


@pytest.mark.parametrize("folder", ["held_out_process_clock", "held_out", "held_out_2026-12-04"])
def test_held_out_workloads_stored_errors(folder):
    """Issue 46's check on kept measurements (benchmarks/sim/results/<folder>/): the six held-out workloads
    (cbteach.sim.measure.HELD_OUT), measured by benchmarks/sim/measure_cpu.py and predicted by a device
    calibrated over their shape on the same occasion -- every step inside the calibrated range, and the
    stored report is what the code computes now. Timed in process CPU seconds (other programs' time not
    counted), and on the wall clock on the quiet machine with `python benchmarks/sim/held_out.py` (its load
    stored beside it), the mean absolute errors are under 10% on TTFT, TPOT, E2E and throughput. The first
    wall-clock check (held_out_2026-12-04/, before score tensors past the caches were charged) is kept as
    it was: its TTFT error, 12.8%, is over the target (benchmarks/sim/README.md says why). Pure arithmetic
    on stored numbers: deterministic."""
    from cbteach.sim.calibrate import load_device
    from cbteach.sim.measure import HELD_OUT

    path = Path(__file__).parent.parent / "benchmarks/sim/results" / folder
    report = validation_report(json.loads((path / "runs.json").read_text()), load_device(path / "device.json"))
    assert [p["run"] for p in report["held_out"]] == [s.name for s in HELD_OUT]
    assert all(p["steps_outside_calibration"] == 0 for p in report["held_out"])
    text = (path / "validation.txt").read_text()
    for metric in ("ttft_error", "tpot_error", "e2e_error", "throughput_error"):
        assert f"{metric}: {report['mae'][metric]:.4g}" in text
        if folder != "held_out_2026-12-04":
            assert report["mae"][metric] < 0.10, (metric, report["mae"])


def test_calibrate_names_a_shape_it_cannot_use(tmp_path, capsys):
    """`simulate calibrate --shape-of` with a file that is not measured runs, or a shape no engine has, is a
    one-line error naming the flag -- before anything is measured."""
    from cbteach.__main__ import main
    from cbteach.sim.calibrate import WorkloadShape

    for text in ("not json", "{}", '{"runs": [{"steps": []}]}'):
        bad = tmp_path / "runs.json"
        bad.write_text(text)
        assert main(["simulate", "calibrate", "--shape-of", str(bad), "--out", str(tmp_path / "d.json")]) == 2
        err = capsys.readouterr().err
        assert f"--shape-of {bad}" in err and "Traceback" not in err
    assert not (tmp_path / "d.json").exists()
    with pytest.raises(ValueError, match="max_batch"):
        WorkloadShape(max_batch=0)
    with pytest.raises(ValueError, match="prompt_lens"):
        WorkloadShape(prompt_lens=(9, 3))


def test_validate_says_when_a_runs_ttft_hangs_on_its_step_times(capsys):
    """Near saturation a queue forms, and the simulated mean TTFT moves many times faster than the step times
    behind it: in the first stored held-out check (benchmarks/sim/results/held_out_2026-12-04/), 2% slower
    steps move the near-saturation Poisson run's TTFT by over 5% per 1% of step time, and a run without a
    queue by about 1%. `simulate validate` reports that sensitivity per run and warns for the first only, naming it.
    Deterministic: stored measurements, replayed by the simulator."""
    from cbteach.__main__ import main
    from cbteach.sim.calibrate import load_device

    path = Path(__file__).parent.parent / "benchmarks/sim/results/held_out_2026-12-04"
    runs, device = path / "runs.json", path / "device.json"
    report = validation_report(json.loads(runs.read_text()), load_device(device))
    sensitivity = {p["run"]: p["ttft_per_step_error"] for p in report["held_out"]}
    assert sensitivity["poisson-near-saturation"] > 5.0, sensitivity
    assert sensitivity["decode-heavy"] < 2.0 and sensitivity["mixed-budget512"] < 2.0, sensitivity
    assert main(["simulate", "validate", "--device", str(device), "--data", str(runs)]) == 0
    warned = [line for line in capsys.readouterr().out.splitlines() if "a 1% error in step time" in line]
    assert len(warned) == 1 and "poisson-near-saturation" in warned[0], warned


def test_bad_workloads_are_refused_with_the_reason():
    """Each of these gave numpy's or Python's error (``IndexError``, ``low >= high``, ``KeyError: 0``), a
    simulation that 'made no progress', negative or zero latencies, or ran 19,999 requests for ``-1``."""
    from cbteach.sim.simulator import SimRequest

    for args, message in [((0, 1.0), "num_requests must be an integer >= 1"),
                          ((2.5, 1.0), "num_requests must be an integer >= 1"),
                          ((5, "1"), "rate must be None"), ((5, math.nan), "rate must be None"),
                          ((20, 1e-300), "raise the rate"),
                          ((5, 1.0, (5, 1)), "prompt_lens must be a pair"),
                          ((5, 1.0, (0, 5)), "prompt_lens must be a pair"),
                          ((5, 1.0, (4, 8), (-5, -1)), "output_lens must be a pair")]:
        with pytest.raises(ValueError, match=message):
            synthetic_workload(*args)
    cost = CostModel("llama-3-8b", "a100-80gb")
    good = [SimRequest(0, 0.0, 8, 4), SimRequest(1, 0.5, 8, 4)]
    run = dict(max_batch_size=4, num_blocks=64)
    for workload, step_time, message in [
            ([SimRequest(0, 0.0, 8, 4), SimRequest(0, 0.5, 8, 4)], cost, "appears twice"),
            ([SimRequest(0, math.nan, 8, 4)], cost, "arrival_time must be a finite number"),
            ([SimRequest(0, math.inf, 8, 4)], cost, "arrival_time must be a finite number"),
            (good, lambda plan: -0.01, "a step's cost must be a finite number of seconds >= 0"),
            (good, lambda plan: math.nan, "a step's cost must be a finite number of seconds >= 0")]:
        with pytest.raises(ValueError, match=message):
            simulate(workload, step_time, **run)
    deploy = Deployment(model="llama-3-8b", device="a100-80gb", max_requests=50)
    for n in (0, -1):
        with pytest.raises(ValueError, match="num_requests must be an integer >= 1"):
            deploy.run(1.0, num_requests=n)
    assert len(deploy.run(1.0, num_requests=3).ttft) == 3


def test_capacity_helpers_refuse_what_would_give_a_wrong_answer_silently():
    from cbteach.sim.simulator import SimRequest

    run = simulate([SimRequest(0, 0.0, 8, 4)], CostModel("llama-3-8b", "a100-80gb"), max_batch_size=2, num_blocks=8)
    with pytest.raises(ValueError, match="the targets must be numbers of seconds > 0"):
        meets(run, math.nan, 1.0)  # (False before, as if the run had missed a target)
    with pytest.raises(ValueError, match="metric must be 'ttft', 'tpot' or 'e2e'"):
        run.quantile("bogus", 0.5)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        gpus_for_users(10, 0.1, 10.0, tensor_parallel_size=0)  # (0 devices before)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        simulate_static([SimRequest(0, 0.0, 8, 4)], CostModel("llama-3-8b", "a100-80gb"), 0)
    with pytest.raises(ValueError, match="workload is empty"):
        compare_batching(workload=[])  # (the default workload before, without a word)
    with pytest.raises(ValueError, match="price per device-hour"):
        cost_per_million_tokens(Deployment(model="llama-3-8b", device="a100-80gb"), 1.0, -1)
