"""A randomized differential test over every feature the engine combines.

Each case draws an architecture, a KV cache (concat, paged, or paged on a plugged-in manager), a pool
size, a token budget, prefix caching, a policy, a preemption mode, the parallel-sampling design,
async scheduling and speculative decoding where they apply, and a workload with ``n > 1`` samples,
seeded and greedy requests, shared prefixes and arrivals on a simulated clock. Every greedy sample
must equal per-prompt ``model.generate``, every seeded sample the same request run alone, and no
KV block may be left in use. Cases are seeded: a failure names its seed.
"""
from __future__ import annotations

import random

import pytest

from cbteach import Engine, Request, SamplingParams
from cbteach.bench.memory_experiments import ReservingKVManager
from conftest import ARCHS, VOCAB, reference, sim_clock, tiny_model
from test_plug_points import FreeListManager, my_attention, my_slot_mapping

MODELS = {arch: tiny_model(arch) for arch in ARCHS}


def draw_case(seed: int) -> tuple[dict, list[Request], str]:
    g = random.Random(seed)
    arch = g.choice(ARCHS)
    kv = g.choice(["concat", "paged", "paged", "paged", "reserve", "freelist", "pieces"])
    opts: dict = {"max_batch_size": g.randint(1, 5)}
    if kv != "concat":
        opts.update(kv="paged", block_size=1 if kv == "reserve" else g.choice([1, 2, 4, 16]))
        opts["num_blocks"] = 400 if kv == "reserve" else g.choice([None, "tight", "roomy"])
        if kv in ("paged", "pieces"):
            opts["prefix_caching"] = g.random() < 0.5
            if g.random() < 0.3:
                opts.update(admission="whole_prompt")
    if g.random() < 0.5:
        opts["token_budget"] = g.randint(3, 24)
    opts["policy"] = g.choice(["fcfs", "priority"])
    if opts["policy"] == "priority" and g.random() < 0.5:
        opts["preempt_to_admit"] = True
    opts["parallel_sampling"] = "fork" if kv in ("concat", "paged", "pieces") and g.random() < 0.4 else "fanout"
    if kv != "concat" and opts.get("admission") != "whole_prompt":
        pick = g.random()
        if pick < 0.3:
            opts["async_scheduling"] = True
        elif pick < 0.5:
            opts["speculative"] = "ngram"
        elif pick < 0.6:
            opts["preemption"] = "swap"
    if opts["parallel_sampling"] == "fork":
        opts["max_batch_size"] = max(opts["max_batch_size"], 3)
    prefix = [g.randrange(6, VOCAB) for _ in range(g.randint(0, 12))]
    reqs = []
    for i in range(g.randint(2, 7)):
        prompt = (prefix if g.random() < 0.5 else []) + [g.randrange(6, VOCAB) for _ in range(g.randint(1, 14))]
        n = g.choice([1, 1, 2, 3])
        seeded = g.random() < 0.4
        params = SamplingParams(temperature=0.9, seed=g.randrange(1000), n=n) if seeded else SamplingParams(n=n)
        reqs.append(Request(prompt, g.randint(1, 12), request_id=f"r{i}", ignore_eos=g.random() < 0.3,
                            priority=g.randint(0, 2), arrival_time=g.choice([0.0, 0.0, 0.02, 0.05]),
                            sampling_params=params))
    if opts.get("num_blocks") in ("tight", "roomy"):  # room for the longest request alone, or three of them
        bs = opts["block_size"]
        need = max(-(-(len(r.prompt) + r.max_new_tokens) // bs) for r in reqs)
        opts["num_blocks"] = need + g.randint(0, 2) if opts["num_blocks"] == "tight" else 3 * need
    if kv == "freelist":
        opts.pop("prefix_caching", None)
    return opts, reqs, arch + ("" if kv in ("concat", "paged") else "+" + kv)


def case_pieces(label: str, opts: dict) -> dict:
    """The plugged-in pieces a case's label names (``+reserve``, ``+freelist``, ``+pieces``), as ``Engine`` keywords."""
    if label.endswith("+reserve"):
        return {"kv_manager": ReservingKVManager(opts["num_blocks"])}
    if label.endswith("+freelist"):
        return {"kv_manager": FreeListManager}
    if label.endswith("+pieces"):
        return {"attention": my_attention, "slot_mapping": my_slot_mapping}
    return {}


def _alone(model, r: Request, i: int) -> list[int]:
    p = r.sampling_params
    eng = Engine(model, max_batch_size=1)
    one = Request(r.prompt, r.max_new_tokens, ignore_eos=r.ignore_eos,
                  sampling_params=SamplingParams(temperature=p.temperature, seed=p.seed + i))
    return eng.run([one])[0].output_ids


@pytest.mark.parametrize("seed", range(int(__import__("os").environ.get("CBTEACH_FUZZ_CASES", "40"))))
def test_every_feature_combination_is_exact_and_leaks_nothing(seed):
    opts, reqs, label = draw_case(seed)
    model = MODELS[label.split("+")[0]]
    eng = Engine(model, clock=sim_clock(0.01), **opts, **case_pieces(label, opts))
    got = eng.run(reqs)
    for r, c in zip(reqs, got):
        samples = c.samples or [c]
        for i, s in enumerate(samples):
            if r.sampling_params.greedy:
                want = reference(model, r.prompt, r.max_new_tokens, eos_id=-1 if r.ignore_eos else 5)
            else:
                want = _alone(model, r, i)
            assert s.output_ids == want, f"seed {seed}: {opts} request {r.request_id} sample {i}"
    assert not eng.has_unfinished()
    if opts.get("kv") == "paged":
        usage = eng.kv_usage()
        assert usage["num_used_blocks"] == 0, f"seed {seed}: blocks leaked ({opts})"
