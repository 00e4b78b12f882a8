"""Issue 19's defects, each pinned by a test that failed on the engine before the fix.

1-3. The engine never changes model state that anybody else reads: padded static batching and a
     padded batched ``generate`` in a thread beside a paged run, two paged engines in two threads,
     a concat engine built during a paged run -- all exact, none refused, no exception.
4-5. Disaggregated serving: the clock moves on to a slow handover's arrival; completions keep
     ``num_cached_prompt_tokens``.
6.   Priority + swap: a request is never swapped in and sent away in the same step.
7.   A temperature so small that dividing by it overflows is greedy, and stops nobody.
8.   An absolute clock time as ``arrival_time`` is refused.
9.   Streams: every covered request ends with exactly one closing event, whoever drove the engine.
The references are per-prompt ``model.generate`` (conftest), never our own earlier output.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from cbteach import Engine, Request, SamplingParams, static_batching
from cbteach.serving.disagg import DisaggregatedServer
from conftest import EOS, VOCAB, drain, reference, tiny_model

PROMPTS = [[7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33, 34, 35, 36], [40, 41, 42]]  # ragged: padding needed


def _paged_runs_beside(model, foreground, rounds: int = 3):
    """Run paged engines on ``model`` in a thread, one ``run()`` after another, while ``foreground()``
    runs ``rounds`` times in this thread. Returns (foreground results, engine outputs, errors)."""
    expected = [reference(model, p, 12) for p in PROMPTS]
    stop, first_step = threading.Event(), threading.Event()
    engine_outputs, errors = [], []

    def hook(module, args, kwargs):  # the background run is really inside a forward pass now
        first_step.set()

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)

    def background():
        try:
            while not stop.is_set():
                eng = Engine(model, max_batch_size=4, kv="paged", block_size=4)
                engine_outputs.append([c.output_ids for c in eng.run([Request(p, 12) for p in PROMPTS])])
        except Exception as err:  # pragma: no cover - the failure is reported below
            errors.append(err)
            first_step.set()

    t = threading.Thread(target=background, daemon=True)
    t.start()
    try:
        first_step.wait(timeout=60)
        handle.remove()
        results = [foreground() for _ in range(rounds)]
    finally:
        stop.set()
        t.join(timeout=120)
    assert not t.is_alive(), "the background engine did not stop"
    assert not errors, f"the paged engine failed in its thread: {errors[0]!r}"
    assert engine_outputs and all(out == expected for out in engine_outputs)
    return results


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_padded_static_batching_and_generate_beside_a_paged_run(arch):
    model = tiny_model(arch)
    expected = [reference(model, p, 8) for p in PROMPTS]
    attn_before = model.config._attn_implementation

    def padded_static():
        res = static_batching(model, None, [Request(p, 8, ignore_eos=False) for p in PROMPTS], batch_size=4)
        return [c.output_ids for c in res]

    def padded_generate():  # left-padded batch with an attention mask, as transformers users write it
        width = max(map(len, PROMPTS))
        ids = torch.tensor([[EOS] * (width - len(p)) + p for p in PROMPTS])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=8, eos_token_id=EOS,
                             pad_token_id=EOS)
        return [_trim(row[width:].tolist()) for row in out]

    for got in _paged_runs_beside(model, padded_static) + _paged_runs_beside(model, padded_generate):
        assert got == expected
    assert model.config._attn_implementation == attn_before  # nobody else ever saw another implementation


def _trim(tokens):
    """generate pads a finished row with pad (= EOS) tokens: keep up to and including the first EOS."""
    return tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens


def test_two_paged_engines_in_two_threads():
    model = tiny_model("qwen2")

    def other_engine():
        eng = Engine(model, max_batch_size=3, kv="paged", block_size=2, num_blocks=40)
        return [c.output_ids for c in eng.run([Request(p, 12) for p in reversed(PROMPTS)])]

    expected = [reference(model, p, 12) for p in reversed(PROMPTS)]
    assert all(got == expected for got in _paged_runs_beside(model, other_engine, rounds=12))


def test_a_concat_engine_can_be_built_and_run_during_a_paged_run():
    model = tiny_model("llama")

    def concat_engine():
        eng = Engine(model, max_batch_size=2)  # used to be refused: the model "uses 'cbteach_paged'"
        return [c.output_ids for c in eng.run([Request(p, 6) for p in PROMPTS])]

    expected = [reference(model, p, 6) for p in PROMPTS]
    assert all(got == expected for got in _paged_runs_beside(model, concat_engine))


def test_the_model_is_left_as_found():
    model = tiny_model("gpt2").train()  # dropout on: the engine runs its own view in eval mode
    config_before = model.config.to_dict()
    eng = Engine(model, max_batch_size=2, kv="paged", block_size=4)
    got = eng.run([Request(p, 6) for p in PROMPTS[:2]])
    assert model.training and all(m.training for m in model.modules())
    assert model.config.to_dict() == config_before and model.config._attn_implementation == "sdpa"
    model.eval()
    assert [c.output_ids for c in got] == [reference(model, p, 6) for p in PROMPTS[:2]]


# -- 4, 5. disaggregated serving --------------------------------------------------------------------
def test_disaggregation_waits_for_a_slow_handover():
    model = tiny_model("llama")
    reqs = [Request([7 + i, 8, 9, 10], 14, request_id=f"r{i}", ignore_eos=True, arrival_time=1.0 if i == 2 else 0.0)
            for i in range(3)]
    server = DisaggregatedServer(model, block_size=2, link_bytes_per_s=1e3, decode_options={"num_blocks": 14})
    got = server.run(reqs)  # used to raise "made no progress"
    assert [c.output_ids for c in got] == [reference(model, r.prompt, 14) for r in reqs]
    assert server.transfers["requests"] == 3


def test_disaggregated_completions_keep_cached_prompt_tokens():
    model = tiny_model("gpt2")
    prefix = list(range(10, 30))  # 20 tokens: five full blocks of 4
    reqs = [Request(prefix + [40 + i], 4, request_id=f"r{i}", arrival_time=0.5 * i, ignore_eos=True)
            for i in range(2)]
    server = DisaggregatedServer(model, block_size=4, prefill_options={"prefix_caching": True},
                                 step_time=0.01)  # r1 arrives 50 steps after r0, on any machine
    got = server.run(reqs)
    assert [c.output_ids for c in got] == [reference(model, r.prompt, 4) for r in reqs]
    assert got[1].num_cached_prompt_tokens == server.prefill.completions["r1"].num_cached_prompt_tokens == 20


# -- 6. priority + swap ---------------------------------------------------------------------------------
def test_a_request_is_never_swapped_in_and_preempted_in_one_step():
    model = tiny_model("llama")
    # 6 blocks of 2: a and b outgrow it, b (the later of equals) is swapped out; the urgent request
    # queues behind it. When a's room frees, b comes back -- and may not be sent away in that step.
    eng = Engine(model, max_batch_size=3, kv="paged", block_size=2, num_blocks=6, policy="priority",
                 preemption="swap", preempt_to_admit=True)
    a = Request([7, 8, 9, 10], 8, request_id="a", priority=5, ignore_eos=True)
    b = Request([11, 12, 13, 14], 6, request_id="b", priority=5, ignore_eos=True)
    urgent = Request(list(range(20, 26)), 4, request_id="u", priority=0, ignore_eos=True)
    eng.add_request(a)
    eng.add_request(b)
    added = False
    for _ in range(1000):  # bounded: a hang must name itself
        if not eng.has_unfinished():
            break
        record = eng.step()
        if not added and record.preempted:  # a is out: the urgent request queues behind it
            eng.add_request(urgent)
            added = True
    assert not eng.has_unfinished(), "still running after 1000 steps"
    assert added, "the pool must be small enough that a request is swapped out"
    assert any(r.swapped_in for r in eng.records) and any(r.preempted == ["b"] and "u" in r.admitted
                                                          for r in eng.records)
    assert all(not set(r.swapped_in) & set(r.preempted) for r in eng.records)
    got = [eng.completions[r.request_id] for r in (a, b, urgent)]
    assert [c.output_ids for c in got] == [reference(model, r.prompt, r.max_new_tokens) for r in (a, b, urgent)]


# -- 7. underflowing temperature --------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-6])
def test_a_tiny_temperature_is_greedy_and_stops_nobody(temperature):
    model = tiny_model("qwen2")
    params = SamplingParams(temperature=temperature, seed=1)
    assert params.greedy
    reqs = [Request(PROMPTS[0], 8, sampling_params=params), Request(PROMPTS[1], 8)]
    got = Engine(model, max_batch_size=2, kv="paged").run(reqs)
    assert [c.output_ids for c in got] == [reference(model, r.prompt, 8) for r in reqs]


# -- 8. absolute arrival times -----------------------------------------------------------------------
def test_an_absolute_clock_time_is_refused_as_arrival_time():
    eng = Engine(tiny_model("gpt2"), max_batch_size=2)
    with pytest.raises(ValueError, match="absolute clock time.*time.time"):
        eng.add_request(Request([7, 8], 3, arrival_time=time.time()))
    with pytest.raises(ValueError, match="absolute clock time"):
        eng.run([Request([7, 8], 3), Request([9], 2, arrival_time=time.time())])
    assert not eng.has_unfinished()  # nothing was queued
    assert eng.run([Request([7, 8], 3, arrival_time=0.01)])[0].finish_reason in ("eos", "length")


# -- 9. streams -------------------------------------------------------------------------------------
def _closing(events, rid):
    return [e for e in events if e.request_id == rid and e.finish_reason is not None]


def test_a_request_aborted_before_the_first_next_gets_its_closing_event():
    model = tiny_model("gpt2")
    eng = Engine(model, max_batch_size=2, kv="paged")
    a, b = Request(PROMPTS[0], 8, request_id="a"), Request(PROMPTS[1], 8, request_id="b")
    stream = eng.stream([a, b])
    eng.abort("a")
    events = list(stream)
    assert [(e.token_id, e.finish_reason) for e in _closing(events, "a")] == [(None, "aborted")]
    assert [e.token_id for e in events if e.request_id == "b"] == reference(model, b.prompt, 8)
    assert len(_closing(events, "b")) == 1
    assert eng.kv_usage()["num_used_blocks"] == 0


@pytest.mark.parametrize("driver", ["stream", "run"])
def test_a_suspended_stream_catches_up_when_someone_else_drives(driver):
    model = tiny_model("llama")
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4)
    a, b = Request(PROMPTS[0], 10, request_id="a"), Request(PROMPTS[2], 10, request_id="b")
    first = eng.stream([a])
    head = [next(first)]  # first is suspended after its first event
    if driver == "stream":
        others = list(eng.stream([b]))  # drains the engine: a finishes too
        assert {e.request_id for e in others} == {"b"}  # it reports on its own requests only
    else:
        eng.run([b])
    assert not eng.has_unfinished()
    events = head + list(first)
    assert [e.token_id for e in events] == reference(model, a.prompt, 10)
    assert len(_closing(events, "a")) == 1 and events[-1].finish_reason is not None


def test_a_stream_reports_requests_added_while_it_streams():
    model = tiny_model("qwen2")
    eng = Engine(model, max_batch_size=2)
    stream = eng.stream([Request(PROMPTS[1], 5, request_id="a")])
    events = [next(stream)]
    eng.add_request(Request(PROMPTS[3], 5, request_id="late"))
    events += list(stream)
    assert [e.token_id for e in events if e.request_id == "late"] == reference(model, PROMPTS[3], 5)
    assert len(_closing(events, "late")) == 1 and len(_closing(events, "a")) == 1


def test_random_prompts_stay_exact_with_a_tiny_temperature_among_sampled_ones():
    model = tiny_model("gpt2")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(6, VOCAB, (int(n),), generator=g).tolist() for n in (3, 9, 5)]
    reqs = [Request(p, 6, sampling_params=SamplingParams(temperature=1e-30)) for p in prompts]
    reqs.append(Request([7, 8], 6, sampling_params=SamplingParams(temperature=0.8, seed=3)))
    got = Engine(model, max_batch_size=4, kv="paged", block_size=2).run(reqs)
    assert [c.output_ids for c in got[:3]] == [reference(model, p, 6) for p in prompts]
    assert len(got[3].output_ids) >= 1


# -- found by a random-workload fuzzer (each failed before its fix) -----------------------------------
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_a_step_that_only_preempts_is_not_taken_for_idleness(preemption):
    # Priority: the first running request needs a block and is itself the least urgent, so it is its
    # own victim and the running loop stops (vLLM V1) before anyone ran. That step preempted: the
    # engine goes on (it used to wait for an arrival, find none and raise "made no progress").
    model = tiny_model("gpt2")
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, num_blocks=2, policy="priority",
                 preemption=preemption)
    a = Request([11, 12, 13], 6, request_id="A", priority=1, ignore_eos=True)
    b = Request([21, 22, 23], 2, request_id="B", priority=0, ignore_eos=True)
    eng.add_request(a)
    eng.step()
    eng.add_request(b)
    eng.step()
    eng.run([])
    only_preempted = [r for r in eng.records if not r.seqs]
    assert only_preempted and all(r.preempted and not r.admitted for r in only_preempted)
    assert [eng.completions[r.request_id].output_ids for r in (a, b)] == [reference(model, r.prompt, r.max_new_tokens)
                                                                         for r in (a, b)]


@pytest.mark.parametrize("step_time", [1e-7, 1e-3, 0.1])  # B arrives before, during or after A's handover
def test_disaggregation_goes_on_after_a_step_that_only_preempted(step_time):
    model = tiny_model("gpt2")
    server = DisaggregatedServer(model, max_batch_size=4, block_size=4, step_time=step_time,
                                 prefill_options=dict(max_batch_size=1, policy="priority"),
                                 decode_options=dict(num_blocks=2, policy="priority"))
    reqs = [Request([11], 7, request_id="A", priority=1, ignore_eos=True),
            Request([21], 4, request_id="B", priority=0, ignore_eos=True, arrival_time=1e-6)]
    got = server.run(reqs)
    assert [c.output_ids for c in got] == [reference(model, r.prompt, r.max_new_tokens) for r in reqs]


def test_a_stream_closed_or_dropped_before_reading_aborts_its_requests():
    import gc

    eng = Engine(tiny_model("gpt2"), max_batch_size=4, kv="paged", block_size=4)
    eng.stream([Request([1, 2, 3], 5, request_id="a")]).close()
    dropped = eng.stream([Request([4, 5, 6], 5, request_id="b")])
    del dropped
    gc.collect()
    assert [eng.sequences[r].status.value for r in ("a", "b")] == ["aborted", "aborted"]
    assert not eng.has_unfinished() and eng.kv_usage()["num_used_blocks"] == 0


def test_a_request_added_while_the_last_event_is_held_is_streamed():
    model = tiny_model("gpt2")
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4)
    events = []
    for ev in eng.stream([Request([1, 2, 3], 2, request_id="a", ignore_eos=True)]):
        events.append(ev)
        if ev.finish_reason and ev.request_id == "a":
            eng.add_request(Request([4, 5, 6], 2, request_id="b", ignore_eos=True))
    assert [e.token_id for e in events if e.request_id == "b"] == reference(model, [4, 5, 6], 2)


def test_numbers_of_any_real_type_sample_and_a_non_bool_ignore_eos_is_refused():
    from fractions import Fraction

    model = tiny_model("gpt2")
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4)
    params = SamplingParams(temperature=Fraction(1, 2), top_p=Fraction(9, 10), seed=1)
    assert isinstance(params.temperature, float) and isinstance(params.top_p, float)
    got = eng.run([Request([5, 6, 7], 4, sampling_params=params), Request([1, 2, 3, 4], 4, request_id="good")])
    assert got[1].output_ids == reference(model, [1, 2, 3, 4], 4)
    with pytest.raises(ValueError, match="ignore_eos must be True or False"):
        eng.add_request(Request([1, 2], 3, ignore_eos="false"))


def test_waiting_after_a_step_that_only_preempted_does_not_raise():
    # A hand-written loop that waits whenever nothing ran (as loops written before such steps did):
    # after a step that only preempted, wait_for_arrival returns and the next step goes on.
    model = tiny_model("gpt2")
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, num_blocks=2, policy="priority")
    eng.add_request(Request([11, 12, 13], 6, request_id="A", priority=1, ignore_eos=True))
    eng.step()
    eng.add_request(Request([21, 22, 23], 2, request_id="B", priority=0, ignore_eos=True))
    drain(eng)
    assert eng.completions["A"].output_ids == reference(model, [11, 12, 13], 6)
