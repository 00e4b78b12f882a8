"""Parallel sampling with copy on write (the PagedAttention paper, section 4.4).

``SamplingParams(n=k)`` gives ``k`` samples of one prompt. The prompt is computed once; the samples
share its KV blocks by reference count, and a shared block is copied only when one sample writes
into it. Each seeded sample ``i`` must equal the same request run alone with ``seed + i``; greedy
samples must equal per-prompt ``model.generate``; no block may leak; preempting one sample must not
corrupt its siblings.
"""
from __future__ import annotations

import pytest

from cbteach import Engine, Request, SamplingParams, static_batching
from cbteach.serving.disagg import DisaggregatedServer
from conftest import ARCHS, reference, step_until, tiny_model

PROMPT = [7, 8, 9, 10, 11]  # 5 tokens: the last block of 4 is partly filled, so samples must copy it


def _alone(model, prompt, max_new, seed, i, **options):
    """Sample ``i`` run as a request of its own, with the seed that sample draws from."""
    params = SamplingParams(temperature=1.0, seed=seed + i)
    eng = Engine(model, max_batch_size=2, **options)
    return eng.run([Request(prompt, max_new, sampling_params=params, ignore_eos=True)])[0].output_ids


def _no_leak(eng):
    usage = eng.kv_usage()
    assert usage["num_used_blocks"] == 0 and usage["block_tables"] == {}
    assert all(c == 0 for c in eng.kv.manager.allocator.ref_counts)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv", ["paged", "concat"])
def test_greedy_samples_each_equal_generate(arch, kv):
    model = tiny_model(arch)
    reqs = [Request(PROMPT, 10, request_id="a", sampling_params=SamplingParams(n=3)), Request([20, 21], 8)]
    got = Engine(model, max_batch_size=4, kv=kv, block_size=4).run(reqs)
    expected = reference(model, PROMPT, 10)
    assert [s.output_ids for s in got[0].samples] == [expected] * 3
    assert got[0].output_ids == expected and got[1].output_ids == reference(model, [20, 21], 8)
    assert [s.request_id for s in got[0].samples] == [("a", 0), ("a", 1), ("a", 2)]


@pytest.mark.parametrize("block_size,prompt", [(4, PROMPT), (4, PROMPT[:4]), (1, PROMPT), (16, PROMPT)])
@pytest.mark.parametrize("kv", ["paged", "concat"])
def test_seeded_samples_each_equal_the_sample_run_alone(block_size, prompt, kv):
    model = tiny_model("llama")
    options = dict(kv=kv, block_size=block_size)
    params = SamplingParams(temperature=1.0, seed=11, n=3)
    eng = Engine(model, max_batch_size=4, **options)
    got = eng.run([Request(prompt, 12, sampling_params=params, ignore_eos=True)])[0]
    assert [s.output_ids for s in got.samples] == [_alone(model, prompt, 12, 11, i, **options) for i in range(3)]
    assert len({tuple(s.output_ids) for s in got.samples}) > 1  # they are different samples
    if kv == "paged":
        _no_leak(eng)


def test_samples_share_the_prompt_blocks_and_copy_only_on_write():
    model = tiny_model("qwen2")
    params = SamplingParams(temperature=1.0, seed=3, n=4)
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4)
    eng.run([Request(list(range(10, 21)), 6, sampling_params=params, ignore_eos=True)])  # 11 tokens: 2 full + 3
    forked = next(r for r in eng.records if len(r.seqs) == 4)  # the first step with all four samples
    # The step before it computed the prompt once (3 blocks); the fork itself copied nothing.
    assert eng.records[0].kv_usage["num_used_blocks"] == 3 and eng.records[0].num_tokens == 11
    # Each sample writes token 12 into the shared third block: the first three copy it, the last
    # one finds it its own; the two full blocks stay shared by all four.
    assert forked.kv_usage["num_cow_copies"] == 3
    assert forked.kv_usage["num_shared_blocks"] == 2
    separate = Engine(model, max_batch_size=4, kv="paged", block_size=4)
    separate.run([Request(list(range(10, 21)), 6, request_id=i, ignore_eos=True,
                          sampling_params=SamplingParams(temperature=1.0, seed=3 + i)) for i in range(4)])
    peak = max(r.kv_usage["num_used_blocks"] for r in eng.records)
    assert peak < max(r.kv_usage["num_used_blocks"] for r in separate.records)
    _no_leak(eng)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preempting_one_sample_leaves_its_siblings_exact(preemption):
    model = tiny_model("llama")
    params = SamplingParams(temperature=1.0, seed=5, n=3)
    eng = Engine(model, max_batch_size=3, kv="paged", block_size=2, num_blocks=14, preemption=preemption)
    got = eng.run([Request(PROMPT, 14, sampling_params=params, ignore_eos=True)])[0]
    assert any(r.preempted for r in eng.records), "the pool must be small enough to preempt a sample"
    options = dict(kv="paged", block_size=2)
    assert [s.output_ids for s in got.samples] == [_alone(model, PROMPT, 14, 5, i, **options) for i in range(3)]
    _no_leak(eng)


def test_a_request_with_samples_waits_for_room_for_all_of_them():
    model = tiny_model("gpt2")
    eng = Engine(model, max_batch_size=3, kv="paged", block_size=4)
    reqs = [Request([20, 21, 22], 6, request_id="one"), Request(PROMPT, 6, request_id="n", sampling_params=SamplingParams(n=3))]
    got = eng.run(reqs)
    assert max(len(r.seqs) for r in eng.records) <= 3
    assert [s.output_ids for s in got[1].samples] == [reference(model, PROMPT, 6)] * 3
    assert got[0].output_ids == reference(model, [20, 21, 22], 6)


def test_aborting_a_request_aborts_every_sample_and_frees_the_blocks():
    model = tiny_model("llama")
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, token_budget=2)
    eng.add_request(Request(PROMPT, 8, request_id="x", sampling_params=SamplingParams(n=3)))
    eng.step()  # the prompt is still being prefilled: the other samples have not forked yet
    done = eng.abort("x")
    assert done.finish_reason == "aborted" and [s.finish_reason for s in done.samples] == ["aborted"] * 3
    assert not eng.has_unfinished()
    _no_leak(eng)
    eng.add_request(Request(PROMPT, 8, request_id="y", sampling_params=SamplingParams(n=2)))
    step_until(eng, lambda: len(eng.records) >= 5, "five steps")
    assert eng.abort("y").samples[1].output_ids  # forked and decoding when aborted
    _no_leak(eng)


def test_a_stream_reports_every_sample():
    model = tiny_model("qwen2")
    eng = Engine(model, max_batch_size=4, kv="paged")
    events = list(eng.stream([Request(PROMPT, 6, request_id="s", sampling_params=SamplingParams(n=2))]))
    for i in range(2):
        mine = [e for e in events if e.request_id == ("s", i)]
        assert [e.token_id for e in mine] == reference(model, PROMPT, 6)
        assert [e.finish_reason is not None for e in mine].count(True) == 1


def test_bad_sample_counts_are_refused():
    model = tiny_model("gpt2")
    for n in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="n \\(samples per prompt\\)"):
            SamplingParams(n=n)
    eng = Engine(model, max_batch_size=2)
    with pytest.raises(ValueError, match="n=3 samples.*max_batch_size"):
        eng.add_request(Request(PROMPT, 4, sampling_params=SamplingParams(n=3)))
    with pytest.raises(ValueError, match="static batching runs one sample"):
        static_batching(model, None, [Request(PROMPT, 4, sampling_params=SamplingParams(n=2))], batch_size=2)
    with pytest.raises(ValueError, match="n > 1"):
        DisaggregatedServer(model).run([Request(PROMPT, 4, sampling_params=SamplingParams(n=2))])


def test_aborting_one_sample_before_it_forked_keeps_it_aborted():
    model = tiny_model("llama")
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4)
    eng.add_request(Request(list(range(10, 20)), 6, request_id="r", ignore_eos=True, sampling_params=SamplingParams(n=3)))
    assert eng.abort(("r", 1)).finish_reason == "aborted"
    eng.run([])
    samples = eng.completions["r"].samples
    assert [(s.finish_reason, len(s.output_ids)) for s in samples] == [("length", 6), ("aborted", 0), ("length", 6)]
    assert samples[2].output_ids == reference(model, list(range(10, 20)), 6)
    _no_leak(eng)


def test_a_sample_id_cannot_be_taken_by_another_request():
    eng = Engine(tiny_model("gpt2"), max_batch_size=4, kv="paged", block_size=4)
    with pytest.raises(ValueError, match="duplicate request_id"):
        eng.run([Request([1, 2, 3], 3, request_id=("x", 1)),
                 Request([7, 8, 9], 3, request_id="x", sampling_params=SamplingParams(n=2))])
    assert not eng.has_unfinished()
