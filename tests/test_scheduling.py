"""Scheduling policies: FCFS and priority, recompute and swap preemption, abort, streaming.

Every invariant is a test named after what it checks; then a property test runs many random
workloads over pool sizes, block sizes, budgets and every policy combination, each compared token
for token with per-prompt ``model.generate`` (``CBTEACH_SCHED_WORKLOADS=5000`` runs more).
"""
import math
import os
import random

import pytest
import torch

from cbteach import Engine, Request
from cbteach.engine.policies import FCFSQueue, WaitingQueue
from cbteach.core.request import RequestStatus
from conftest import EOS, VOCAB, reference, sim_clock, step_until, tiny_model

MODEL = tiny_model("llama")
_refs: dict = {}


def expected(prompt, max_new_tokens):
    """generate's greedy output, from one long reference per prompt (greedy output is a prefix)."""
    key = tuple(prompt)
    if key not in _refs:
        _refs[key] = reference(MODEL, prompt, 24)
    full = _refs[key]
    if max_new_tokens > 24:
        return reference(MODEL, prompt, max_new_tokens)
    out = full[:max_new_tokens]
    return out[:out.index(EOS) + 1] if EOS in out else out


def check_invariants(eng, budget=None, record=None):
    """Checked after every step of a paged engine."""
    kv, sched = eng.kv, eng.scheduler
    owners = {}
    for seq in sched.running:
        assert seq.status is RequestStatus.RUNNING
        assert len(seq.block_table) == math.ceil(seq.num_computed_tokens / kv.block_size), seq
        for b in seq.block_table:
            assert b not in owners, f"block {b} owned twice"
            owners[b] = seq.request_id
    for seq in sched.waiting:
        assert seq.block_table == [] and seq.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
    swapped = getattr(sched, "swapped", [])  # V0Scheduler's (swap preemption)
    swap_space = getattr(kv, "swap_space", {})  # its cache's host copies (kv/swap.py)
    for seq in swapped:
        assert seq.block_table == [] and seq.status is RequestStatus.PREEMPTED
        # blocks conserved: the host copy holds exactly the blocks of its computed tokens
        assert swap_space[seq.request_id][0][0].shape[0] == math.ceil(seq.num_computed_tokens / kv.block_size)
    # (an aborted one's host copy goes at once: test_an_aborted_swapped_out_request_leaves_no_host_copy)
    assert set(swap_space) == {s.request_id for s in swapped}
    ref = kv.manager.allocator.ref_counts
    assert sum(1 for c in ref if c > 0) == len(owners)
    assert kv.manager.num_free_blocks == kv.num_blocks - len(owners)
    if record is not None:
        if budget is not None:
            assert record.num_tokens <= budget
        for s in record.seqs:  # no token before a (chunked) prompt is complete
            seq = eng.sequences[s.request_id]
            if s.sampled is not None:
                assert s.num_computed_tokens + s.num_scheduled_tokens >= len(seq.prompt_ids)
        assert not set(record.admitted) & set(record.preempted), "re-admitted in the step that preempted it"


def drain(eng, budget=None, check=True):
    records = []
    while eng.has_requests():
        assert len(records) < 5000, "no progress: the scheduler is stuck"
        rec = eng.step()
        records.append(rec)
        if check and eng.kv.kind == "paged":
            check_invariants(eng, budget, rec)
    if eng.kv.kind == "paged":
        assert eng.kv.manager.num_free_blocks == eng.kv.num_blocks, "blocks leaked"
        assert all(c == 0 for c in eng.kv.manager.allocator.ref_counts)
        assert not getattr(eng.kv, "swap_space", None)
    assert not len(eng.scheduler.waiting) and not eng.scheduler.running and not getattr(eng.scheduler, "swapped", [])
    return records


def pressure_requests(seed=3):
    g = torch.Generator().manual_seed(seed)
    return [Request(torch.randint(6, VOCAB, (int(n),), generator=g).tolist(), int(m), request_id=i)
            for i, (n, m) in enumerate([(20, 30), (5, 40), (30, 10), (12, 25), (2, 35), (25, 20)])]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_no_leaks_after_draining_and_exact_under_pressure(policy, preemption):
    reqs = pressure_requests()
    for i, r in enumerate(reqs):
        r.priority = i % 3
    eng = Engine(MODEL, max_batch_size=4, kv="paged", block_size=4, num_blocks=14, token_budget=8,
                 policy=policy, preemption=preemption)
    for r in reqs:
        eng.add_request(r)
    records = drain(eng, budget=8)
    assert any(r.preempted for r in records), "this pool must preempt"
    assert [eng.completions[r.request_id].output_ids for r in reqs] == [expected(r.prompt, r.max_new_tokens)
                                                                       for r in reqs]


def test_swap_moves_blocks_to_the_host_and_back():
    eng = Engine(MODEL, max_batch_size=4, kv="paged", block_size=4, num_blocks=14, preemption="swap")
    for r in pressure_requests():
        eng.add_request(r)
    records = drain(eng)
    assert any(r.swapped_in for r in records)
    stats = eng.kv.swap_stats
    assert stats["bytes_out"] == stats["bytes_in"] > 0  # everything swapped out came back
    assert all(eng.sequences[rid].num_preemptions > 0 for r in records for rid in r.swapped_in)


def test_fcfs_victim_is_the_newest_running_request():
    q = FCFSQueue()
    eng = Engine(MODEL, max_batch_size=3, kv="paged", block_size=4, num_blocks=40)
    for r in [Request([7, 8], 3, request_id="a"), Request([9], 3, request_id="b"), Request([10], 3, request_id="c")]:
        eng.add_request(r)
    eng.step()
    assert q.pick_victim(eng.scheduler.running).request_id == "c"


def test_priority_victim_is_least_urgent_then_latest():
    # On a simulated clock (a step costs 0.01 s) "c" arrives after the first step, whatever the
    # machine's speed: on the wall clock a fast machine finished a, b and d before c arrived.
    eng = Engine(MODEL, max_batch_size=4, kv="paged", block_size=4, num_blocks=40, policy="priority",
                 clock=sim_clock(0.01))
    for rid, prio, at in [("a", 1, 0.0), ("b", 2, 0.0), ("c", 2, 0.001), ("d", 0, 0.0)]:
        eng.add_request(Request([7, 8], 3, request_id=rid, priority=prio, arrival_time=at))
    step_until(eng, lambda: len(eng.scheduler.running) == 4, "all four requests running together", max_steps=3)
    assert eng.records[0].admitted == ["d", "a", "b"] and eng.records[1].admitted == ["c"]
    assert eng.scheduler.waiting.pick_victim(eng.scheduler.running).request_id == "c"


def test_priority_order_with_arrival_tie_break():
    eng = Engine(MODEL, max_batch_size=1, kv="paged", block_size=4, num_blocks=40, policy="priority")
    for rid, prio in [("low", 5), ("urgent", 0), ("mid", 2), ("urgent2", 0)]:
        eng.add_request(Request([7, 8], 2, request_id=rid, priority=prio))
    order = [rid for rec in drain(eng) for rid in rec.admitted]
    assert order == ["urgent", "urgent2", "mid", "low"]


def two_bulk_requests_filling_the_pool(preempt_to_admit=True):
    """Room for two running bulk requests only: under V0's rule an urgent arrival takes a less urgent
    one's blocks (``preempt_to_admit``); under V1's it waits for room."""
    eng = Engine(MODEL, max_batch_size=4, kv="paged", block_size=4, num_blocks=10, policy="priority",
                 preempt_to_admit=preempt_to_admit)
    eng.add_request(Request(list(range(6, 22)), 12, request_id="bulk1", priority=5))
    eng.add_request(Request(list(range(30, 46)), 12, request_id="bulk2", priority=5))
    eng.step()
    eng.step()
    eng.add_request(Request(list(range(50, 62)), 3, request_id="urgent", priority=0))
    return eng


def test_urgent_arrival_preempts_less_urgent_only_under_memory_pressure():
    eng = two_bulk_requests_filling_the_pool()
    rec = eng.step()
    assert rec.admitted == ["urgent"] and rec.preempted == ["bulk2"]
    drain(eng)
    for rid, p, n in [("bulk1", range(6, 22), 12), ("bulk2", range(30, 46), 12), ("urgent", range(50, 62), 3)]:
        assert eng.completions[rid].output_ids == expected(list(p), n)
    # Without pressure nobody is preempted.
    eng = Engine(MODEL, max_batch_size=4, kv="paged", block_size=4, num_blocks=64, policy="priority",
                 preempt_to_admit=True)
    eng.add_request(Request(list(range(6, 22)), 12, priority=5))
    eng.step()
    eng.add_request(Request([7, 8], 3, priority=0))
    assert not any(r.preempted for r in drain(eng))


def test_v1_preempts_only_for_running_requests():
    """vLLM V1 (the default): the urgent arrival waits for room; no running request is preempted to admit it."""
    eng = two_bulk_requests_filling_the_pool(preempt_to_admit=False)
    records = drain(eng)
    admitted_urgent = next(r for r in records if "urgent" in r.admitted)
    assert not admitted_urgent.preempted
    assert not any(r.preempted and r.admitted for r in records)
    for rid, p, n in [("bulk1", range(6, 22), 12), ("bulk2", range(30, 46), 12), ("urgent", range(50, 62), 3)]:
        assert eng.completions[rid].output_ids == expected(list(p), n)


def test_nobody_else_is_admitted_in_the_step_an_urgent_arrival_preempted():
    # The urgent request preempts bulk2; a small request would then fit, but the room was short a
    # moment ago (the rule for any step that preempted): it waits for the next step.
    eng = two_bulk_requests_filling_the_pool()
    eng.add_request(Request([7, 8], 3, request_id="small", priority=1))
    rec = eng.step()
    assert rec.admitted == ["urgent"] and rec.preempted == ["bulk2"]
    assert "small" in eng.step().admitted
    drain(eng)
    for rid, p, n in [("bulk1", range(6, 22), 12), ("bulk2", range(30, 46), 12), ("urgent", range(50, 62), 3),
                      ("small", [7, 8], 3)]:
        assert eng.completions[rid].output_ids == expected(list(p), n)


def test_stop_conditions_eos_kept_and_length():
    g = random.Random(0)
    for _ in range(100):  # find a prompt that stops at EOS by itself
        p = [g.randrange(6, VOCAB) for _ in range(4)]
        out = expected(p, 24)
        if out and out[-1] == EOS and len(out) < 24:
            break
    else:
        pytest.skip("no prompt stops at EOS")
    eng = Engine(MODEL, max_batch_size=2, kv="paged", block_size=4)
    got = eng.run([Request(p, 24), Request(p, 2), Request(p, 24, ignore_eos=True)])
    assert got[0].output_ids[-1] == EOS and got[0].finish_reason == "eos"
    assert len(got[1].output_ids) == 2 and got[1].finish_reason == "length"
    assert len(got[2].output_ids) == 24 and got[2].finish_reason == "length"


def test_token_budget_never_exceeded_and_prompt_completes_before_a_token():
    eng = Engine(MODEL, max_batch_size=3, kv="paged", block_size=2, token_budget=5)
    reqs = [Request(list(range(6, 30)), 4), Request([7], 6), Request(list(range(40, 52)), 3)]
    for r in reqs:
        eng.add_request(r)
    records = drain(eng, budget=5)
    chunks = [s for r in records for s in r.seqs if s.kind == "prefill" and s.sampled is None]
    assert chunks, "the 24-token prompt must be chunked"


@pytest.mark.parametrize("where", ["running", "queued", "swapped"])
def test_abort_frees_everything_and_leaves_the_others_exact(where):
    preemption = "swap" if where == "swapped" else "recompute"
    eng = Engine(MODEL, max_batch_size=2 if where == "queued" else 4, kv="paged", block_size=4, num_blocks=14,
                 preemption=preemption)
    reqs = pressure_requests()
    for r in reqs:
        eng.add_request(r)
    target = None
    for _ in range(200):
        eng.step()
        check_invariants(eng)
        pool = {"running": eng.scheduler.running, "queued": list(eng.scheduler.waiting),
                "swapped": getattr(eng.scheduler, "swapped", [])}[where]
        cands = [s for s in pool if s.output_ids] or pool
        if cands:
            target = cands[0]
            break
    assert target is not None, f"no request was ever {where}"
    so_far = list(target.output_ids)
    done = eng.abort(target.request_id)
    assert done.finish_reason == "aborted" and done.output_ids == so_far
    check_invariants(eng)
    drain(eng)
    assert not getattr(eng.kv, "swap_space", None), "the worker still holds the aborted request's host copy"
    for r in reqs:
        if r.request_id != target.request_id:
            assert eng.completions[r.request_id].output_ids == expected(r.prompt, r.max_new_tokens)


def test_abort_unknown_or_finished_request_is_refused():
    eng = Engine(MODEL, max_batch_size=2, kv="paged")
    eng.run([Request([7], 2, request_id="x")])
    with pytest.raises(ValueError, match="already finished"):
        eng.abort("x")
    with pytest.raises(ValueError, match="unknown request_id 'nope'"):
        eng.abort("nope")
    with pytest.raises(ValueError, match="unknown request_id"):
        eng.abort(["unhashable"])


def test_a_never_fitting_request_is_refused_without_disturbing_others():
    eng = Engine(MODEL, max_batch_size=2, kv="paged", block_size=4, num_blocks=6)
    eng.add_request(Request([7, 8, 9], 10, request_id="ok"))
    eng.step()
    with pytest.raises(ValueError, match="needs up to 8 KV blocks.*only 6"):
        eng.add_request(Request(list(range(6, 26)), 12, request_id="huge"))
    drain(eng)
    assert eng.completions["ok"].output_ids == expected([7, 8, 9], 10)
    assert "huge" not in eng.sequences


def test_streamed_tokens_add_up_to_the_completions(bierce):
    model, tok = bierce
    from cbteach.bierce.corpus import headword_prompts

    eng = Engine(model, tok, max_batch_size=3, kv="paged")
    reqs = [Request(p, 30) for p in headword_prompts(5)]
    tokens, texts, finish = {}, {}, {}
    for ev in eng.stream(reqs):
        assert finish.get(ev.request_id) is None, "event after the request's last token"
        tokens.setdefault(ev.request_id, []).append(ev.token_id)
        texts[ev.request_id] = texts.get(ev.request_id, "") + ev.text
        finish[ev.request_id] = ev.finish_reason
    for r in reqs:
        c = eng.completions[r.request_id]
        assert tokens[r.request_id] == c.output_ids
        assert texts[r.request_id] == c.text
        assert finish[r.request_id] == c.finish_reason
    assert model.config._attn_implementation != "cbteach_paged"


@pytest.mark.parametrize("kv", ["concat", "paged"])
def test_a_stream_ends_every_request_and_a_dropped_stream_frees_its_blocks(kv):
    reqs = [Request([7 + i, 8], 10, request_id=i, ignore_eos=True) for i in range(4)]
    eng = Engine(MODEL, max_batch_size=2, kv=kv, block_size=4)
    events = {}
    for n, ev in enumerate(eng.stream(reqs)):
        events.setdefault(ev.request_id, []).append(ev)
        if n == 3:
            eng.abort(0)  # running
            eng.abort(3)  # still queued
    for r in reqs:
        last = events[r.request_id][-1]
        assert [e.finish_reason for e in events[r.request_id]].count(None) == len(events[r.request_id]) - 1
        assert last.finish_reason == eng.completions[r.request_id].finish_reason
    assert events[3] == [events[3][0]] and events[3][0].token_id is None and events[3][0].finish_reason == "aborted"
    assert [e.token_id for e in events[0][:-1]] == eng.completions[0].output_ids
    for r in reqs[1:3]:
        assert eng.completions[r.request_id].output_ids == reference(MODEL, r.prompt, 10, eos_id=-1)
    # A consumer that stops listening: its unfinished requests are aborted and give their blocks back.
    more = [Request([20 + i], 10, request_id=f"m{i}", ignore_eos=True) for i in range(3)]
    stream = eng.stream(more)
    next(stream), next(stream)
    stream.close()
    assert not eng.has_unfinished()
    assert {eng.completions[r.request_id].finish_reason for r in more} == {"aborted"}
    if kv == "paged":
        assert eng.kv_usage()["num_free_blocks"] == eng.kv.num_blocks
    assert MODEL.config._attn_implementation == "sdpa"


def test_a_custom_policy_plugs_in():
    class ShortestPromptFirst(WaitingQueue):
        name = "spf"

        def key(self, seq):
            return (len(seq.prompt_ids), seq.arrival_time)

    eng = Engine(MODEL, max_batch_size=1, kv="paged", block_size=4, policy=ShortestPromptFirst)
    for rid, n in [("long", 9), ("short", 2), ("mid", 5)]:
        eng.add_request(Request(list(range(6, 6 + n)), 2, request_id=rid))
    assert [rid for rec in drain(eng) for rid in rec.admitted] == ["short", "mid", "long"]
    with pytest.raises(ValueError, match="policy must be one of"):
        Engine(MODEL, max_batch_size=1, policy="lifo")
    with pytest.raises(ValueError, match="preemption must be one of"):
        Engine(MODEL, max_batch_size=1, preemption="drop")


# -- the property test ----------------------------------------------------------------------------
def test_random_workloads_pools_and_policies_match_generate():
    n_workloads = int(os.environ.get("CBTEACH_SCHED_WORKLOADS", "500"))  # (more: a deeper run, as the fuzz's)
    rng = random.Random(1911)
    prompts = [[rng.randrange(6, VOCAB) for _ in range(rng.randint(1, 14))] for _ in range(40)]
    for p in prompts:
        expected(p, 1)
    preemptions = 0
    for w in range(n_workloads):
        bs = rng.choice([1, 2, 4, 8])
        reqs = [Request(rng.choice(prompts), rng.randint(1, 20), priority=rng.randint(0, 2),
                        request_id=f"w{w}-{i}") for i in range(rng.randint(1, 5))]
        need = max(math.ceil((len(r.prompt) + r.max_new_tokens - 1) / bs) for r in reqs)
        budget = rng.choice([None, None, 4, 16])
        kv = "concat" if rng.random() < 0.1 else "paged"
        eng = Engine(MODEL, max_batch_size=rng.randint(1, 4), kv=kv, block_size=bs,
                     num_blocks=need + rng.choice([0, 0, 1, 3, 8, 64]), token_budget=budget,
                     policy=rng.choice(["fcfs", "priority"]), preemption=rng.choice(["recompute", "swap"]))
        for r in reqs:
            eng.add_request(r)
        records = drain(eng, budget, check=w % 4 == 0)  # full invariants on a quarter: keeps it quick
        preemptions += sum(len(r.preempted) for r in records)
        for r in reqs:
            got = eng.completions[r.request_id].output_ids
            assert got == expected(r.prompt, r.max_new_tokens), f"workload {w}: {r}"
    assert preemptions > n_workloads // 10, "the pools were never tight"


def test_an_aborted_swapped_out_request_leaves_no_host_copy():
    """V0's swap keeps a preempted request's K/V in host memory; aborting it must let go of that copy at
    once, not when some later message reaches the worker (an idle engine sends none)."""
    eng = Engine(MODEL, max_batch_size=4, kv="paged", block_size=4, num_blocks=14, preemption="swap")
    reqs = pressure_requests()
    for r in reqs:
        eng.add_request(r)
    step_until(eng, lambda: getattr(eng.scheduler, "swapped", []), "a request swapped out")
    victims = [s.request_id for s in eng.scheduler.swapped]
    for rid in victims:
        eng.abort(rid)
    assert eng.kv_usage()["num_swapped"] == 0 and not eng.kv.swap_space
    assert eng.run([]) == []
    for r in reqs:
        if r.request_id not in victims:
            assert eng.completions[r.request_id].output_ids == expected(r.prompt, r.max_new_tokens)
    assert eng.kv_usage()["num_used_blocks"] == 0
