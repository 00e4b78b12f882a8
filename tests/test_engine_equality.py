"""Every batching strategy gives, token for token, what per-prompt ``model.generate`` gives.

Greedy, fp32, CPU; GPT-2, Llama (GQA) and Qwen2 tiny random-weight models with eager and sdpa
attention, random workloads from hypothesis, and the embedded bierce model on real headwords.
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbteach import Engine, Request, static_batching
from conftest import ARCHS, EOS, VOCAB, reference, tiny_model

SETTINGS = settings(max_examples=8, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

workloads = st.lists(
    st.tuples(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=64), st.integers(1, 128)),
    min_size=1, max_size=10)

_models = {}


def model_for(arch, attn="sdpa"):
    # The reference and the engine may share a model object: engines never change its weights.
    key = (arch, attn)
    if key not in _models:
        _models[key] = tiny_model(arch, attn)
    return _models[key]


def check(completions, model, reqs):
    for c, r in zip(completions, reqs):
        expected = reference(model, r.prompt, r.max_new_tokens)
        assert c.output_ids == expected, f"request {r.request_id}: {c.output_ids} != generate's {expected}"
        assert c.prompt_ids == list(r.prompt)
        stopped = bool(expected) and expected[-1] == EOS
        assert c.finish_reason == ("eos" if stopped else "length")


@pytest.mark.parametrize("arch", ARCHS)
@given(work=workloads, batch=st.integers(1, 8))
@SETTINGS
def test_continuous_matches_generate(arch, work, batch):
    model = model_for(arch)
    reqs = [Request(p, n) for p, n in work]
    check(Engine(model, max_batch_size=batch).run(reqs), model, reqs)


@pytest.mark.parametrize("arch", ARCHS)
@given(work=workloads, batch=st.integers(1, 8))
@SETTINGS
def test_static_matches_generate(arch, work, batch):
    model = model_for(arch)
    reqs = [Request(p, n) for p, n in work]
    check(static_batching(model, None, reqs, batch), model, reqs)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("strategy", ["static", "concat", "paged"])
def test_each_attention_implementation(arch, attn, strategy):
    model = tiny_model(arch, attn)  # fresh: kv="paged" switches the model's attention function
    g = torch.Generator().manual_seed(7)
    reqs = [Request(torch.randint(0, VOCAB, (int(n),), generator=g).tolist(), int(m))
            for n, m in [(1, 30), (17, 5), (40, 60), (3, 1), (9, 45)]]
    expected = [reference(model, r.prompt, r.max_new_tokens) for r in reqs]
    if strategy == "static":
        got = static_batching(model, None, reqs, 2)
    else:
        got = Engine(model, max_batch_size=3, kv=strategy, block_size=4).run(reqs) if strategy == "paged" \
            else Engine(model, max_batch_size=3).run(reqs)
    assert [c.output_ids for c in got] == expected


def test_a_request_stops_at_eos_before_its_limit():
    """Make sure the EOS path is exercised: find prompts whose generation stops by itself."""
    model = model_for("llama")
    g = torch.Generator().manual_seed(0)
    stopping = []
    for _ in range(200):
        p = torch.randint(6, VOCAB, (4,), generator=g).tolist()
        out = reference(model, p, 60)
        if out and out[-1] == EOS and len(out) < 60:
            stopping.append(Request(p, 60))
        if len(stopping) == 3:
            break
    assert stopping, "the tiny model never produced EOS; pick another EOS id"
    reqs = stopping + [Request([7, 8, 9], 60)]
    got = Engine(model, max_batch_size=2).run(reqs)
    assert [c.finish_reason for c in got[:len(stopping)]] == ["eos"] * len(stopping)
    check(got, model, reqs)


def test_token_budget_chunks_prefill_and_stays_exact():
    model = model_for("qwen2")
    reqs = [Request(list(range(6, 56)), 20), Request([9, 10], 30), Request(list(range(20, 80)), 10)]
    eng = Engine(model, max_batch_size=3, token_budget=8)
    got = eng.run(reqs)
    assert max(r.num_tokens for r in eng.records) <= 8
    assert any(s.kind == "prefill" and s.sampled is None for r in eng.records for s in r.seqs), "no chunk seen"
    check(got, model, reqs)


def test_prefill_fuses_with_decode_in_one_pass():
    model = model_for("gpt2")
    reqs = [Request([7, 8, 9], 2), Request([10, 11], 12), Request([12, 13, 14, 15], 4)]
    eng = Engine(model, max_batch_size=2)
    got = eng.run(reqs)
    fused = [r for r in eng.records if r.is_fused]
    assert fused, "the third request's prefill should ride with the second's decode"
    assert fused[0].admitted == [reqs[2].request_id]
    assert len(fused[0].input_ids) == 1 + 4
    check(got, model, reqs)


def test_finished_slot_is_refilled_on_the_next_step():
    model = model_for("llama")
    reqs = [Request([7], 1), Request([8, 9], 20), Request([10, 11, 12], 3)]
    eng = Engine(model, max_batch_size=2)
    eng.run(reqs)
    finished_at = next(r.step for r in eng.records if reqs[0].request_id in r.finished)
    admitted_at = next(r.step for r in eng.records if reqs[2].request_id in r.admitted)
    assert admitted_at == finished_at + 1
    slot_a = eng.records[finished_at].seqs[0].slot
    slot_c = next(s.slot for s in eng.records[admitted_at].seqs if s.request_id == reqs[2].request_id)
    assert slot_a == slot_c


def test_bierce_headwords_all_strategies(bierce):
    from cbteach.bierce.corpus import headword_prompts

    model, tok = bierce
    prompts = headword_prompts(8)
    reqs = [Request(p, 48) for p in prompts]
    expected = []
    for p in prompts:
        ids = tok(p, return_tensors="pt")
        out = model.generate(**ids, do_sample=False, max_new_tokens=48)
        expected.append(out[0, ids["input_ids"].shape[1]:].tolist())
    for got in (static_batching(model, tok, reqs, 3), Engine(model, tok, max_batch_size=3).run(reqs)):
        assert [c.output_ids for c in got] == expected
        assert got[0].text == tok.decode(expected[0], skip_special_tokens=True)


def test_eos_comes_from_generation_config_without_tokenizer():
    model = tiny_model("llama")
    model.generation_config.eos_token_id = [EOS, 11]
    eng = Engine(model, max_batch_size=2)
    assert eng.info.eos_ids == {EOS, 11}


def test_arrival_times_are_respected_and_fcfs_by_arrival():
    model = model_for("llama")
    late = Request([7, 8], 4, request_id="late", arrival_time=0.05)
    early = Request([9, 10], 4, request_id="early", arrival_time=0.0)
    eng = Engine(model, max_batch_size=1)
    got = eng.run([late, early])
    assert [c.request_id for c in got] == ["late", "early"]  # results in request order
    first = eng.records[0]
    assert first.admitted == ["early"]
    # arrival times in run() count from the start of the call: "late" arrives 0.05 s after "early"
    assert got[0].arrival_time - got[1].arrival_time == pytest.approx(0.05)
    assert got[0].first_token_time >= got[0].arrival_time
    assert all(r.seqs for r in eng.records)
    check(got, model, [late, early])
