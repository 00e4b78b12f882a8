"""Notebook 06's self-check accepts correct policies and names what a broken one breaks; its helpers."""
import time

import pytest

from cbteach import Engine, Request
from cbteach.exercises import ex06
from cbteach.core.policies import FCFSQueue, PriorityQueue, WaitingQueue
from cbteach.viz import latency as lat
from conftest import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


class ShortestPromptFirst(WaitingQueue):
    def key(self, seq):
        return (len(seq.prompt_ids), seq.arrival_time)


class LengthOnly(WaitingQueue):  # ties fall back on the queue's stable insertion order: also right
    def key(self, seq):
        return len(seq.prompt_ids)


class AgingPriority(WaitingQueue):  # the notebook's "going further": starvation-free, static keys
    def key(self, seq):
        return seq.request.priority * 10.0 + seq.arrival_time


class LongestFirst(WaitingQueue):
    def key(self, seq):
        return -len(seq.prompt_ids)


class ArrivalOrder(WaitingQueue):
    def key(self, seq):
        return seq.arrival_time


class Lifo(WaitingQueue):
    def key(self, seq):
        return -seq.arrival_time


class WrongTieBreak(WaitingQueue):
    def key(self, seq):
        return (len(seq.prompt_ids), -seq.arrival_time)


class VictimFromTheQueue(ShortestPromptFirst):
    def pick_victim(self, running):
        return next(iter(self), None)  # a waiting request (or None), not a running one


class NoKey(WaitingQueue):
    pass


class ForgotReturn(WaitingQueue):
    def key(self, seq):
        len(seq.prompt_ids)


class LosesRequests(ShortestPromptFirst):
    def add(self, seq):
        if seq.request_id != "r2":
            super().add(seq)


@pytest.mark.parametrize("policy, claim", [
    (ShortestPromptFirst, "shortest-prompt-first"),
    (LengthOnly, "shortest-prompt-first"),
    (ShortestPromptFirst(), "shortest-prompt-first"),  # an instance works too
    (FCFSQueue, "fcfs"),
    ("fcfs", "fcfs"),
    (PriorityQueue, "priority"),
    (AgingPriority, "priority"),
])
def test_accepts_correct_policies(model, capsys, policy, claim):
    assert ex06.check_policy(policy, model, claim=claim)
    out = capsys.readouterr().out
    assert out.startswith("✓") and "preemptions survived" in out


@pytest.mark.parametrize("policy, claim, words", [
    (Lifo, "fcfs", "last in, first out"),
    (LongestFirst, "shortest-prompt-first", "longest first"),
    (ArrivalOrder, "shortest-prompt-first", "arrival order"),
    (WrongTieBreak, "shortest-prompt-first", "equal length"),
    (ArrivalOrder, "priority", "ignores Request.priority"),
    (VictimFromTheQueue, "shortest-prompt-first", "not one of the running requests"),
    (NoKey, "fcfs", "define key(self, seq)"),
    (ForgotReturn, "fcfs", "forget a `return`"),
    (LosesRequests, "shortest-prompt-first", "lose a request"),
    (len, "fcfs", "WaitingQueue"),
])
def test_rejects_broken_policies_with_a_hint(model, capsys, policy, claim, words):
    assert not ex06.check_policy(policy, model, claim=claim)
    out = capsys.readouterr().out
    assert out.startswith("✗") and words in out
    assert "len(seq.prompt_ids)" not in out and "seq.arrival_time" not in out  # hints, never the answer


def test_the_broken_victim_is_caught_on_the_tight_pool(model, capsys):
    ex06.check_policy(VictimFromTheQueue, model)
    assert "tight KV pool" in capsys.readouterr().out


def test_tight_pools_really_preempt_and_the_others_do_not(model):
    for w in ex06.WORKLOADS:
        for policy in (ShortestPromptFirst, FCFSQueue, Lifo):
            _, records = ex06.run_workload(policy, model, w)
            preempted = sum(len(r.preempted) for r in records)
            assert (preempted > 0) == (not w.claim_holds), (w.name, policy.__name__)


def test_check_is_deterministic_and_quick(model, capsys):
    t0 = time.perf_counter()
    ex06.check_policy(ShortestPromptFirst, model)
    first = capsys.readouterr().out
    ex06.check_policy(ShortestPromptFirst, model)
    assert capsys.readouterr().out == first
    assert time.perf_counter() - t0 < 30


def test_unknown_claim_is_refused(model, capsys):
    for claim in ("fastest", None, ["fcfs"]):
        assert not ex06.check_policy(ShortestPromptFirst, model, claim=claim)
        assert "claim must be one of" in capsys.readouterr().out


# -- the notebook's latency helpers ---------------------------------------------------------------

def test_preemption_events_and_recomputed_tokens(model):
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, num_blocks=14)
    eng.run([Request(p, 14, ignore_eos=True, request_id=f"r{i}") for i, p in enumerate(ex06.prompts(97))])
    events = lat.preemption_events(eng.records)
    preempted = [rid for _, kind, rid, _ in events if kind == "preempted"]
    assert preempted and preempted == [rid for r in eng.records for rid in r.preempted]
    assert sorted(rid for _, kind, rid, _ in events if kind == "readmitted") == sorted(preempted)
    tokens, seconds = lat.recomputed_tokens(eng.records)
    # each recompute prefill redoes the prompt plus what the request had generated when it was preempted
    assert tokens >= sum(len(eng.sequences[rid].prompt_ids) for rid in preempted) and seconds > 0


def test_latency_figures_have_titles_and_axis_labels(model):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, num_blocks=14, preemption="swap")
    done = eng.run([Request(p, 14, ignore_eos=True, request_id=f"r{i}") for i, p in enumerate(ex06.prompts(97))])
    axes = [lat.plot_request_anatomy(done[0]), lat.plot_itl_timeline(done),
            lat.plot_budget_tradeoff([{"budget": None, "worst_itl": 0.3, "ttft": 0.3},
                                      {"budget": 64, "worst_itl": 0.03, "ttft": 0.5}]),
            lat.plot_lanes({"fcfs": {"urgent": (0.3, 0.5)}, "priority": {"urgent": (0.05, 0.1)}})]
    axes += list(lat.plot_preemptions(eng.records, 4).axes)
    assert any(k == "swapped in" for _, k, _, _ in lat.preemption_events(eng.records))
    for ax in axes:
        if ax.get_label() == "<colorbar>":
            continue
        assert ax.get_title() and ax.get_xlabel() and (ax.get_ylabel() or ax.get_yticks().size), ax
    plt.close("all")
    with pytest.raises(ValueError, match="paged engine"):
        lat.plot_preemptions([], 4)


def test_a_policy_name_the_engine_does_not_know_gets_a_hint(model, capsys):
    assert not ex06.check_policy("bogus", model)
    out = capsys.readouterr().out
    assert out.startswith("✗") and "policy must be one of" in out
