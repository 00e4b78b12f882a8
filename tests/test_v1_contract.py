"""The engine follows vLLM V1's contract, and the six defects of issue 26 stay fixed.

* ``num_computed_tokens`` moves at the end of ``schedule()`` (``update_after_schedule``); the plan keeps
  the counts from before; rejected guesses are taken back after the step;
* one request's failure (sampling, non-finite logits, the model on its tokens) ends that request with
  ``finish_reason="error"``; neighbours are exact (greedy and seeded), nothing leaks;
* ``admission="whole_prompt"`` reserves the whole prompt at admission;
* the model changing under an engine is refused; ``close()`` lets go;
* a failed prefix-cache admission leaves the LRU order as it was.
Every token is compared with per-prompt ``model.generate`` or with the same request run alone.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cbteach import Engine, Request, SamplingParams
from cbteach.core.sampling import sample
from cbteach.errors import EngineClosedError, ModelChangedError
from conftest import ARCHS, drain, reference, sim_clock, tiny_model

PROMPTS = [[7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18, 19, 20, 21, 22]]


def _no_leak(eng):
    usage = eng.kv_usage()
    assert usage["num_used_blocks"] == 0 and usage["block_tables"] == {}


# -- V1's placement of num_computed_tokens -------------------------------------------------------------
def test_schedule_moves_num_computed_tokens_and_the_plan_keeps_the_counts_before():
    eng = Engine(tiny_model("llama"), max_batch_size=2, kv="paged", block_size=4, token_budget=4)
    rid = eng.add_request(Request(PROMPTS[2], 3))
    seq = eng.sequences[rid]
    plan = eng.scheduler.schedule(eng.now())
    assert plan.num_computed_tokens_of() == {rid: 0} and plan.num_scheduled_tokens == {rid: 4}
    assert seq.num_computed_tokens == 4  # already counted: the next step could be planned now
    out = eng.executor.execute_model(plan)
    assert out.sampled == [None]  # a chunk that stops short samples nothing
    eng.scheduler.update_from_output(plan, out, eng.now())
    assert seq.num_computed_tokens == 4 and seq.output_ids == []


def test_rejected_guesses_are_taken_back_after_the_step():
    model = tiny_model("gpt2")
    prompt = [7, 8, 9, 10]
    truth = reference(model, prompt, 6)
    eng = Engine(model, max_batch_size=2, kv="paged", block_size=2, speculative="ngram")
    rid = eng.add_request(Request(prompt, 6, ignore_eos=True))
    eng.step()  # the prompt, and the first token
    seq = eng.sequences[rid]
    guesses = [truth[1], (truth[2] + 1) % 97, truth[3]]  # right, wrong, (right but after a wrong one)
    eng.scheduler.proposer = SimpleNamespace(k=3, propose=lambda token_ids, k: list(guesses))
    plan = eng.scheduler.schedule(eng.now())
    assert seq.draft_ids == guesses
    assert plan.num_scheduled_tokens == {rid: 4} and plan.scheduled_spec_decode_tokens == {rid: seq.draft_ids}
    assert seq.num_computed_tokens == 5 + 3  # V1 counts the guesses at planning...
    eng.scheduler.update_from_output(plan, eng.executor.execute_model(plan), eng.now())
    assert seq.output_ids == truth[:3]  # the right guess and the model's own token
    assert seq.num_computed_tokens == 5 + 1  # ... and takes the rejected two back after the step
    assert len(seq.block_table) == 3  # the block that held only rejected guesses went back
    eng.run([])
    assert eng.completions[rid].output_ids == truth


# -- one request's failure is its own ------------------------------------------------------------------
def test_a_top_p_below_float32s_range_keeps_the_most_likely_token():
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    tokens = sample(logits, [SamplingParams(temperature=1.0, top_p=1e-46, seed=0)], [torch.Generator().manual_seed(0)])
    assert tokens == [1]


def _poison_request(model, marker: int):
    """Hooks (public torch API; the engine's view of the model shares them) that make the logits NaN for
    every row whose fed token is ``marker``: a model error on that request's tokens alone."""
    state = {}

    def remember(module, args, kwargs):
        state["ids"], state["rows"] = kwargs.get("input_ids")[0], kwargs.get("logits_to_keep")

    def poison(module, args, output):
        ids, rows = state["ids"], state["rows"]
        fed = ids[rows] if isinstance(rows, torch.Tensor) else ids[-output.shape[1]:]
        output[0, fed == marker] = float("nan")
        return output

    return [model.register_forward_pre_hook(remember, with_kwargs=True),
            model.get_output_embeddings().register_forward_hook(poison)]


@pytest.mark.parametrize("kv", ["paged", "concat"])
def test_a_request_whose_logits_fail_ends_alone_and_its_neighbours_stay_exact(kv):
    model = tiny_model("llama")
    good = [Request(p, 8, request_id=f"g{i}", ignore_eos=True) for i, p in enumerate(PROMPTS)]
    seeded = Request([30, 31, 32], 8, request_id="s", ignore_eos=True,
                     sampling_params=SamplingParams(temperature=1.0, seed=4))
    alone = Engine(model, max_batch_size=4, kv=kv, block_size=4).run([seeded])[0].output_ids
    bad = Request([40, 41, 96], 8, request_id="bad")
    eng = Engine(model, max_batch_size=6, kv=kv, block_size=4)
    hooks = _poison_request(model, 96)
    got = {c.request_id: c for c in eng.run(good + [seeded, bad])}
    for h in hooks:
        h.remove()
    assert got["bad"].finish_reason == "error" and "not finite" in got["bad"].error
    for r in good:
        assert got[r.request_id].output_ids == reference(model, r.prompt, 8) and got[r.request_id].error is None
    assert got["s"].output_ids == alone  # its seeded draws were not disturbed
    assert not eng.has_unfinished()
    if kv == "paged":
        _no_leak(eng)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("bad_first", [True, False], ids=["bad first", "bad last"])
@pytest.mark.parametrize("options", [dict(kv="paged", block_size=4), dict(kv="concat"),
                                     dict(kv="concat", token_budget=3)], ids=["paged", "concat", "concat chunked"])
def test_a_request_whose_keys_and_values_are_nan_ends_alone_now_and_later(arch, bad_first, options):
    """NaN K/V (the model fails on a token of the prompt: its embedding output is NaN) sit in the failed
    request's blocks. Attention reads past a sequence's own keys (a group's padding, a block's stale slots;
    with the concatenating cache, every packed sequence's), masked -- but a masked key's weight 0 times a
    NaN value is NaN. Neither the neighbours of its step (their prompt chunks too) nor the later requests
    that get its freed blocks may fail with it."""
    model = tiny_model(arch)

    def nan_for_96(module, args, output):
        output[args[0] == 96] = float("nan")
        return output

    good = [Request(p, 6, request_id=f"g{i}") for i, p in enumerate([[10, 11, 12, 13, 14, 15, 16, 17, 18], [20, 21, 22]])]
    bad = Request([96, 40, 41, 42, 43], 3, request_id="bad")
    handle = model.get_input_embeddings().register_forward_hook(nan_for_96)
    try:
        want = [reference(model, r.prompt, 6) for r in good]
        eng = Engine(model, max_batch_size=4, **options)
        first = eng.run([Request(bad.prompt, 3)])[0]  # alone: it fails, and its blocks go back to the pool
        assert first.finish_reason == "error"
        got = {c.request_id: c for c in eng.run([bad, *good] if bad_first else [*good, bad])}
        assert got["bad"].finish_reason == "error"
        assert [got[r.request_id].output_ids for r in good] == want, "a neighbour of the failed request failed with it"
        again = eng.run([Request(r.prompt, 6) for r in good])  # in blocks the failed request left behind
        assert [c.output_ids for c in again] == want, "a later request failed in the blocks a failed one left"
    finally:
        handle.remove()
    if options["kv"] == "paged":
        _no_leak(eng)
    else:
        assert eng.kv_usage() == {"num_sequences": 0, "num_tokens": 0}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_nan_request_fails_alone_when_a_neighbour_shares_its_prefix_in_the_same_step(arch, async_scheduling):
    """With prefix caching, a request of the same step reads as its cached prefix the blocks a failing request
    fills -- NaN there (its masked later keys reach its earlier queries: 0 x NaN). The neighbour runs again alone,
    computing those blocks itself, and equals generate; the failing one alone fails. Under async scheduling the
    step behind has already read the neighbour's token: it is not run again, and ends with an error -- never
    with wrong tokens (running it again gave wrong ones)."""
    model = tiny_model(arch)
    head = list(range(10, 22))  # three full blocks of 4, shared
    want = reference(model, head + [7, 8], 6)
    marker = max(set(range(30, 96)) - set(want))  # a token the good request neither has nor makes

    def nan_for_marker(module, args, output):
        output[args[0] == marker] = float("nan")
        return output

    handle = model.get_input_embeddings().register_forward_hook(nan_for_marker)
    try:
        eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, prefix_caching=True,
                     async_scheduling=async_scheduling)
        bad, good = eng.run([Request(head + [marker, 5, 6], 3, request_id="bad"),
                             Request(head + [7, 8], 6, request_id="good")])
        assert bad.finish_reason == "error"
        if async_scheduling:
            assert good.finish_reason == "error" or good.output_ids == want, (good.finish_reason, good.output_ids)
        else:
            assert good.output_ids == want, (good.finish_reason, good.error)
        assert eng.run([Request(head + [7, 8], 6)])[0].output_ids == want  # and later, from the cache
    finally:
        handle.remove()
    _no_leak(eng)


def test_a_model_that_raises_on_one_requests_tokens_fails_only_that_request():
    model = tiny_model("qwen2")

    def refuse(module, args, kwargs):
        if bool((kwargs["input_ids"] == 95).any()):
            raise RuntimeError("the model refuses token 95")

    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4)
    handle = model.register_forward_pre_hook(refuse, with_kwargs=True)
    try:
        got = eng.run([Request(PROMPTS[0], 6, request_id="a"), Request([9, 95, 9], 6, request_id="bad"),
                       Request(PROMPTS[1], 6, request_id="b")])
    finally:
        handle.remove()
    assert [c.finish_reason for c in got][1] == "error" and "refuses token 95" in got[1].error
    assert got[0].output_ids == reference(model, PROMPTS[0], 6) and got[2].output_ids == reference(model, PROMPTS[1], 6)
    _no_leak(eng)


def test_a_stream_ends_a_failed_request_with_one_error_event():
    model = tiny_model("gpt2")
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4)
    hooks = _poison_request(model, 94)
    events = list(eng.stream([Request([20, 21], 4, request_id="ok", ignore_eos=True),
                              Request([22, 94], 4, request_id="bad")]))
    for h in hooks:
        h.remove()
    bad = [e for e in events if e.request_id == "bad"]
    assert [e.finish_reason for e in bad] == ["error"] and bad[0].token_id is None
    ok = [e for e in events if e.request_id == "ok"]
    assert [e.token_id for e in ok] == reference(model, [20, 21], 4) and ok[-1].finish_reason == "length"


# -- V0's whole-prompt admission reserves the whole prompt ------------------------------------------------
def test_whole_prompt_admission_reserves_the_whole_prompt():
    model = tiny_model("llama")
    prompt = list(range(10, 30))  # 20 tokens, fed 4 at a time
    eng = Engine(model, max_batch_size=2, kv="paged", block_size=4, num_blocks=12, token_budget=4,
                 admission="whole_prompt")
    rid = eng.add_request(Request(prompt, 4))
    eng.step()
    seq = eng.sequences[rid]
    assert seq.num_computed_tokens == 4 and len(seq.block_table) == 5  # room for all 20 prompt tokens
    got = eng.run([])
    assert eng.completions[rid].output_ids == reference(model, prompt, 4) and not got
    _no_leak(eng)


# -- the model changing under an engine -------------------------------------------------------------------
@pytest.mark.parametrize("change", ["dtype", "dtype of one layer", "embeddings", "eos", "weights",
                                    "weights through .data"])
def test_changing_the_model_under_an_engine_is_refused(change):
    model = tiny_model("llama")
    eng = Engine(model, max_batch_size=2, kv="paged", block_size=4)
    eng.run([Request([7, 8], 2)])
    if change == "dtype":
        model.to(torch.float64)
    elif change == "dtype of one layer":  # (the first weight keeps its dtype: the check looks at every weight)
        model.lm_head.to(torch.float64)
    elif change == "weights through .data":  # other weights loaded as vector_to_parameters loads them
        torch.nn.utils.vector_to_parameters(torch.nn.utils.parameters_to_vector(
            tiny_model("llama", seed=7).parameters()), model.parameters())
    elif change == "embeddings":
        model.resize_token_embeddings(model.config.vocab_size + 8)
    elif change == "eos":
        model.generation_config.eos_token_id = 3
    else:
        with torch.no_grad():
            next(model.parameters()).add_(0.01)
    with pytest.raises(ModelChangedError, match="build a new Engine"):
        eng.run([Request([7, 8], 2)])
    with pytest.raises(ModelChangedError):
        eng.step()
    if change == "dtype of one layer":
        return  # (a model of two dtypes runs nowhere: generate refuses it too)
    fresh = Engine(model, max_batch_size=2, kv="paged", block_size=4)  # a new engine for the model as it is
    assert fresh.run([Request([7, 8], 2)])[0].output_ids == reference(model, [7, 8], 2, eos_id=model.generation_config.eos_token_id)


def test_a_compiled_model_runs_in_the_engine_as_its_own_eval_mode_forward_and_is_left_as_it_was():
    """``model.compile()`` gives the model a compiled call of itself; the engine's view must not take it (it would
    run the model's own forward: its training flag, dropout on, and its attention, not the paged one)."""
    model = tiny_model("gpt2")
    want = reference(model, [7, 8, 9, 10, 11], 10)
    model.train()
    model.compile(backend="eager")
    for kv in ("concat", "paged"):
        assert Engine(model, max_batch_size=2, kv=kv).run([Request([7, 8, 9, 10, 11], 10)])[0].output_ids == want
    assert model.training


def test_engines_leave_modules_that_are_not_hashable_buildable():
    """The per-step check counts modules registered anywhere in the process (torch's global registration hooks):
    a module class that defines __eq__ without __hash__ (a dataclass module, say) must still build."""
    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def __eq__(self, other):
            return self is other

    with Engine(tiny_model("llama"), max_batch_size=2) as eng:
        assert isinstance(Head(), Head)  # (a TypeError from the engine's hook, before)
        assert eng.run([Request([7, 8, 9], 3)])[0].output_ids == reference(eng.model, [7, 8, 9], 3)


def test_a_model_built_elsewhere_is_not_a_change_but_a_replaced_layer_found_by_step_alone():
    """The per-step check compares a cheap snapshot and walks the model only when a module or parameter
    was set somewhere (cbteach.engine.fingerprint): building another model is no change to this one, a
    layer replaced in this one is caught by the next step, without a run() first."""
    model = tiny_model("llama")
    eng = Engine(model, max_batch_size=2, kv="paged", block_size=4)
    eng.add_request(Request([7, 8, 9], 4, request_id="a"))
    eng.step()
    tiny_model("gpt2")  # modules and parameters registered in this process, none of them this model's
    eng.step()
    model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    with pytest.raises(ModelChangedError, match="module of the model"):
        eng.step()


# -- closing ------------------------------------------------------------------------------------------
def test_close_aborts_what_is_running_and_lets_go_of_the_pool():
    model = tiny_model("gpt2")
    with Engine(model, max_batch_size=2, kv="paged", block_size=4) as eng:
        eng.add_request(Request([7, 8, 9], 20, request_id="x"))
        eng.step()
    assert eng.completions["x"].finish_reason == "aborted" and eng.kv.pool is None
    with pytest.raises(EngineClosedError):
        eng.run([Request([7], 2)])
    eng.close()  # a second close does nothing


# -- prefix caching: V1's same-step sharing and an untouched LRU order ---------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_identical_prompts_admitted_in_one_step_share_their_full_blocks(arch):
    model = tiny_model(arch)
    prompt = list(range(6, 39))  # 33 tokens: two full blocks of 16
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=16, prefix_caching=True)
    got = eng.run([Request(prompt, 5, request_id=i) for i in range(3)])
    assert [c.num_cached_prompt_tokens for c in got] == [0, 32, 32]
    assert all(c.output_ids == reference(model, prompt, 5) for c in got)
    assert eng.records[0].num_prefill_tokens == 33 + 1 + 1


def test_a_refused_admission_leaves_the_prefix_caches_lru_order():
    model = tiny_model("llama")
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, num_blocks=8, prefix_caching=True)
    eng.run([Request(list(range(10, 19)), 1, request_id="warm")])  # 9 tokens: two full blocks stay cached
    eng.add_request(Request(list(range(40, 60)), 8, request_id="big", ignore_eos=True))  # holds 5..7 blocks
    eng.step()
    order = list(eng.kv.manager.allocator.free_blocks)
    eng.add_request(Request(list(range(10, 19)) + list(range(60, 72)), 4, request_id="hit"))  # needs 6, hits 2
    plan = eng.scheduler.schedule(eng.now())
    assert "hit" not in plan.admitted_req_ids  # refused: too little room
    after = list(eng.kv.manager.allocator.free_blocks)
    # Nothing was taken and given back: the blocks still free keep their least-recently-used order.
    assert [b for b in after if b in order] == [b for b in order if b in after]
    assert eng.kv.manager.get_computed_blocks(eng.sequences["hit"])[1] == 8  # its prefix is still findable


def _refuse_token(model, token: int):
    def refuse(module, args, kwargs):
        if bool((kwargs["input_ids"] == token).any()):
            raise RuntimeError(f"the model refuses token {token}")
    return model.register_forward_pre_hook(refuse, with_kwargs=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_failure_beside_a_same_step_prefix_hit_leaves_the_sharer_exact_and_the_cache_clean(arch):
    """``a`` allocates blocks that become findable at once (V1); ``b``, admitted in the same step, finds its
    prefix in them. The model then fails on ``a``'s last token: the blocks were never written. ``b`` computes
    them itself and stays exact, and no later prompt is offered them from the cache."""
    model = tiny_model(arch)
    prefix = list(range(10, 18))  # two full blocks of 4
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, num_blocks=32, prefix_caching=True)
    handle = _refuse_token(model, 95)
    try:
        a, b = eng.run([Request(prefix + [95], 6, request_id="a"), Request(prefix + [30], 6, request_id="b")])
        later, = eng.run([Request(prefix + [31], 6, request_id="later")])
    finally:
        handle.remove()
    assert a.finish_reason == "error" and "refuses token 95" in a.error
    assert b.num_cached_prompt_tokens == 8 and b.output_ids == reference(model, prefix + [30], 6)
    assert later.output_ids == reference(model, prefix + [31], 6)
    _no_leak(eng)


def test_async_scheduling_a_request_that_fails_on_its_first_step_ends_alone():
    """The failing request is already in the next step (planned while its first one ran, on a placeholder):
    that step's token for it is dropped, its record shows none, and its neighbour is exact."""
    model = tiny_model("llama")
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, async_scheduling=True)
    handle = _refuse_token(model, 95)
    try:
        bad, ok = eng.run([Request([20, 21, 95], 5, request_id="bad", ignore_eos=True),
                           Request([10, 11, 12], 5, request_id="ok", ignore_eos=True)])
    finally:
        handle.remove()
    assert bad.finish_reason == "error" and bad.output_ids == []
    assert ok.output_ids == reference(model, [10, 11, 12], 5, eos_id=None)
    parts = [s for r in eng.records for s in r.seqs if s.request_id == "bad"]
    assert len(parts) == 2  # its first step, and the one planned while that ran
    assert all(p.sampled is None and p.new_token_ids == [] for p in parts) and parts[0].finish_reason == "error"
    _no_leak(eng)


class _Ticking:
    """A clock that moves 1 ms at every reading, as wall time moves while the host works."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 0.001
        return self.t

    def advance(self, dt):
        self.t += dt


@pytest.mark.parametrize("arrival", [0.0015, 0.0025, 0.0035, 0.0045])
def test_an_arrival_that_falls_due_while_the_host_works_is_served(arrival):
    """The step saw the arrival ahead of it and did nothing; by the time the engine asks how long to wait,
    it is due. The engine steps again -- no 'made no progress' error."""
    model = tiny_model("gpt2")
    eng = Engine(model, max_batch_size=2, kv="paged", clock=_Ticking())
    done, = eng.run([Request([1, 2, 3], 3, arrival_time=arrival)])
    assert done.output_ids == reference(model, [1, 2, 3], 3)


def test_preempt_to_admit_preempts_nobody_when_cached_blocks_make_room():
    """The newcomer's prefix is held by the running request: it needs one new block, and four are free. V0's
    priority rule must not preempt for room it already has."""
    model = tiny_model("llama")
    running = [(7 * i) % 90 + 6 for i in range(28)]  # seven full blocks of 4
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, num_blocks=11, prefix_caching=True,
                 policy="priority", preempt_to_admit=True)
    eng.add_request(Request(running, 8, request_id="R", priority=2, ignore_eos=True))
    eng.step()
    assert eng.kv_usage()["num_free_blocks"] == 4
    eng.add_request(Request(running + [5], 6, request_id="W", priority=1, ignore_eos=True))
    record = eng.step()
    assert record.preempted == [] and sorted(s.request_id for s in record.seqs) == ["R", "W"]
    drain(eng)
    assert eng.completions["R"].output_ids == reference(model, running, 8, eos_id=None)
    assert eng.completions["W"].output_ids == reference(model, running + [5], 6, eos_id=None)
    _no_leak(eng)


def test_release_forgets_a_finished_request_only():
    model = tiny_model("gpt2")
    eng = Engine(model, max_batch_size=2, kv="paged", block_size=4)
    done = eng.run([Request([7, 8], 3, request_id="a"), Request([9], 2, request_id="n",
                                                                sampling_params=SamplingParams(n=2))])
    eng.add_request(Request([10, 11], 30, request_id="live", ignore_eos=True))
    with pytest.raises(ValueError, match="only a finished or aborted request"):
        eng.release("live")
    with pytest.raises(ValueError, match="not a finished request of this engine"):
        eng.release(["a"])  # unhashable: never a request's id
    eng.release("a")
    eng.release("n")
    assert "a" not in eng.completions and ("n", 1) not in eng.sequences and "n" not in eng.groups
    assert [c.output_ids for c in eng.run([Request([7, 8], 3, request_id="a")])] == [done[0].output_ids]


def test_one_sample_is_not_released_alone():
    """``release(("n", 0))`` was taken: a new request could then take the id, and releasing "n" removed the new
    request's sequence and left its completion behind for good."""
    model = tiny_model("llama")
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4)
    eng.run([Request([7, 8, 9], 4, request_id="n", sampling_params=SamplingParams(temperature=1.0, seed=1, n=2))])
    with pytest.raises(ValueError, match=r"one sample of request 'n'.*release the request's own id"):
        eng.release(("n", 0))
    eng.release("n")
    assert not eng.sequences and not eng.completions and not eng.groups


@pytest.mark.parametrize("kv", ["concat", "paged"])
def test_a_suspended_stream_goes_on_reporting_its_own_request_after_its_id_is_reused(kv):
    """A stream suspended after one event; run() drives its request to the end; the request is released and a
    new one takes its id. The stream ends the old request with the old request's tokens -- before, it went on
    with the new request's (or raised a bare KeyError when the id was not taken again)."""
    model = tiny_model("llama")
    eng = Engine(model, max_batch_size=4, kv=kv, block_size=4)
    s = eng.stream([Request([7, 8, 9], 5, request_id="A", ignore_eos=True)])
    first = next(s)
    eng.run([Request([9, 9], 2, request_id="C")])
    eng.release("A")
    again = eng.stream([Request([5, 6], 3, request_id="B", ignore_eos=True)])  # one that is released before it starts
    eng.run([Request([5, 6], 1, request_id="D")])
    new = eng.run([Request([30, 31, 32, 33], 8, request_id="A", ignore_eos=True)])[0]
    events = [first, *s]
    assert [e.token_id for e in events] == reference(model, [7, 8, 9], 5, eos_id=None)
    assert [e.finish_reason for e in events] == [None] * 4 + ["length"] and all(e.request_id == "A" for e in events)
    assert new.output_ids == reference(model, [30, 31, 32, 33], 8, eos_id=None)
    eng.release("B")
    assert [e.token_id for e in again] == reference(model, [5, 6], 3, eos_id=None)
    if kv == "paged":
        _no_leak(eng)


def _spoil_passes_with(model, token: int):
    """A forward hook that makes every position of a pass NaN when any fed token is ``token``: run alone,
    the request holding it writes NaN over every block it fills -- shared ones included."""
    def spoil(module, args, output):
        if bool((args[0] == token).any()):
            return torch.full_like(output, float("nan"))
    return model.get_input_embeddings().register_forward_hook(spoil)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_failing_owner_run_alone_after_its_sharer_does_not_leave_the_sharer_reading_what_it_wrote(arch):
    """The row order is sharer first, owner second: ``f`` finishes in step 1 and frees row 0, which ``s``
    takes in step 2, while ``o`` (row 1) fills its second chunk -- blocks ``s`` is admitted on in that same
    step. The pass holds ``o``'s poison token, so both rows' logits are NaN and each runs again alone:
    ``s`` first (it computes the shared blocks itself), then ``o``, whose failed run writes NaN over them.
    ``s`` must not read that NaN in the steps after: it stays exact, ``o`` alone fails."""
    model = tiny_model(arch)
    head, poison = list(range(10, 26)), 95  # four full blocks of 4
    o = Request(head + [poison, 40], 4, request_id="o", ignore_eos=True)
    s = Request(head + [30, 31], 6, request_id="s", ignore_eos=True)
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, num_blocks=40, prefix_caching=True,
                 token_budget=12)
    handle = _spoil_passes_with(model, poison)
    try:
        eng.add_request(Request([50, 51, 52], 1, request_id="f", ignore_eos=True))
        eng.add_request(o)
        eng.step()
        eng.add_request(s)
        drain(eng)
    finally:
        handle.remove()
    got = eng.completions
    second = {q.request_id: q for q in eng.records[1].seqs}
    assert second["s"].num_computed_tokens == len(head), "s was meant to be admitted on o's blocks filled that step"
    assert second["o"].num_computed_tokens < len(head) and eng.records[0].finished == ["f"]
    assert got["o"].finish_reason == "error"
    assert got["s"].error is None and got["s"].output_ids == reference(model, s.prompt, 6, eos_id=-1)
    _no_leak(eng)


@pytest.mark.parametrize("kv", ["concat", "paged"])
def test_a_forked_prompt_run_again_alone_still_starts_its_samples(kv):
    """A request with two seeded samples by fork shares its prompt's step with a request whose token spoils
    the whole pass: both rows' logits are NaN, and the prompt runs again alone. The second sample's first
    token is drawn in that run, so it forks and finishes -- it used to wait for a prompt that was done, and
    the run ended without its completion."""
    model = tiny_model("llama")
    params = SamplingParams(n=2, temperature=0.8, seed=3)
    clean = Request([10, 11, 12, 13, 14], 4, request_id="clean", ignore_eos=True, sampling_params=params)
    eng = Engine(model, max_batch_size=4, kv=kv, parallel_sampling="fork",
                 **({"block_size": 4} if kv == "paged" else {}))
    handle = _spoil_passes_with(model, 95)
    try:
        got = {c.request_id: c for c in eng.run([clean, Request([20, 95, 21], 3, request_id="bad")])}
    finally:
        handle.remove()
    assert got["bad"].finish_reason == "error"
    for i, each in enumerate(got["clean"].samples):
        alone = Engine(model, max_batch_size=1).run([Request(clean.prompt, 4, ignore_eos=True,
                                                             sampling_params=SamplingParams(temperature=0.8, seed=3 + i))])
        assert each.error is None and each.output_ids == alone[0].output_ids, i
    assert not eng.has_unfinished()


def _nan_at(model, token: int):
    """A hook that makes the embedding NaN at every position fed ``token`` (a model error on that token)."""
    def nan_at(module, args, out):
        hit = args[0] == token
        if bool(hit.any()):
            out = out.clone()
            out[hit] = float("nan")
            return out
    return model.get_input_embeddings().register_forward_hook(nan_at)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("later_comes", ["the step after", "once bad has failed"])
def test_a_prompt_sharing_a_prefix_spoiled_in_an_earlier_chunk_stays_exact(arch, later_comes):
    """``bad``'s first chunk holds a token the model gives NaN for. The chunk samples nothing, but its last
    position's logits are NaN (it attends to that token), and through attention's 0 * NaN so are the K/V of the
    chunk's earlier positions. ``later`` shares ``bad``'s first 12 tokens: arriving the step after, or once
    ``bad`` has failed, it must not read them from ``bad``'s blocks -- ``bad`` fails at that chunk, and every
    block it filled leaves the prefix cache (they used to stay there past the failed step's start)."""
    model = tiny_model(arch)
    head = list(range(10, 22))
    bad = Request(head + [95] + list(range(30, 40)), 4, request_id="bad")
    later = Request(head + [58], 6, request_id="later", ignore_eos=True)
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, prefix_caching=True, token_budget=16)
    handle = _nan_at(model, 95)
    try:
        eng.add_request(bad)
        if later_comes == "the step after":
            eng.step()
        else:
            drain(eng)
        eng.add_request(later)
        drain(eng)
    finally:
        handle.remove()
    got = eng.completions
    assert got["bad"].finish_reason == "error" and len(eng.records[0].seqs[0].token_ids) == 16  # (a chunk, no token)
    assert got["later"].error is None and got["later"].output_ids == reference(model, later.prompt, 6, eos_id=-1)
    _no_leak(eng)


def test_a_sample_admitted_on_blocks_a_preempted_sibling_failed_to_write_computes_them_itself():
    """Found by the failure fuzz (async scheduling, prefix caching, a pool of single-token blocks). ``r2``'s
    first sample feeds the token the model refuses; its step is still in flight when the next plan preempts
    it, so its blocks go back to the pool findable as computed. Its second sample, admitted later on them,
    must compute them itself from the first unwritten one -- feeding the refused token, so it fails too --
    rather than read K/V nobody wrote. Everyone else stays exact."""
    model = tiny_model("qwen2")
    head = [42, 89, 38, 69, 29, 14, 49, 21, 13, 32]
    greedy = SamplingParams()
    reqs = [Request(head + [65, 95, 25, 94, 90, 18, 58, 11, 51], 1, request_id="r0", arrival_time=0.05,
                    sampling_params=SamplingParams(n=3)),
            Request(head + [65, 13, 64, 45, 60, 20, 74, 86, 30, 42, 77, 84, 70], 3, request_id="r1", priority=2,
                    sampling_params=SamplingParams(n=2)),
            Request(head + [65, 24, 77, 22, 95, 45, 76, 49, 57, 50], 1, request_id="r2", priority=2,
                    sampling_params=SamplingParams(temperature=0.9, seed=123, n=2)),
            Request([46, 31], 7, request_id="r3", ignore_eos=True, sampling_params=greedy),
            Request([30, 74, 40, 56, 14, 7, 14, 23, 69], 1, request_id="r4", priority=2, sampling_params=greedy),
            Request(head + [95, 65, 20, 95, 33, 45, 25], 7, request_id="r5", ignore_eos=True,
                    sampling_params=SamplingParams(n=2)),
            Request([59, 9, 12], 2, request_id="r6", arrival_time=0.02, sampling_params=greedy)]
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=1, num_blocks=30, prefix_caching=True,
                 token_budget=16, policy="priority", preempt_to_admit=True, async_scheduling=True,
                 clock=sim_clock(0.01))
    handle = _refuse_token(model, 95)
    try:
        got = {c.request_id: c for c in eng.run(reqs)}
    finally:
        handle.remove()
    assert any(("r2", 0) in rec.preempted for rec in eng.records), "the case: r2's first sample preempted in flight"
    for r in reqs:
        for s in got[r.request_id].samples or [got[r.request_id]]:
            if 95 in r.prompt:
                assert s.finish_reason == "error", (r.request_id, s)
            else:
                assert s.error is None and s.output_ids == reference(
                    model, r.prompt, r.max_new_tokens, eos_id=-1 if r.ignore_eos else 5), r.request_id
    _no_leak(eng)
