"""Parallel sampling, both designs (:mod:`cbteach.engine.parallel_sampling`).

``SamplingParams(n=k)`` gives ``k`` samples of one prompt: as ``k`` child requests (vLLM V1's fanout,
the default; with prefix caching they share the prompt's full blocks through the cache) or forked
from the computed prompt with copy on write (the PagedAttention paper, section 4.4). Either way each
seeded sample ``i`` must equal the same request run alone with ``seed + i``; greedy samples must equal
per-prompt ``model.generate``; no block may leak; preempting or aborting one sample must not touch
its siblings; a KV manager that cannot share blocks is refused for fork, never silently wrong.
"""
from __future__ import annotations

import pytest

from cbteach import Engine, Request, SamplingParams, static_batching
from cbteach.bench.memory_experiments import ReservingKVManager
from cbteach.serving.disagg import DisaggregatedServer
from conftest import ARCHS, reference, step_until, tiny_model

PROMPT = [7, 8, 9, 10, 11]  # 5 tokens: the last block of 4 is partly filled, so samples must copy it
MODES = ["fanout", "fork"]


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
@pytest.mark.parametrize("mode", MODES)
def test_greedy_samples_each_equal_generate(arch, kv, mode):
    model = tiny_model(arch)
    reqs = [Request(PROMPT, 10, request_id="a", sampling_params=SamplingParams(n=3)), Request([20, 21], 8)]
    got = Engine(model, parallel_sampling=mode, max_batch_size=4, kv=kv, block_size=4).run(reqs)
    expected = reference(model, PROMPT, 10)
    assert [s.output_ids for s in got[0].samples] == [expected] * 3
    assert got[0].output_ids == expected and got[1].output_ids == reference(model, [20, 21], 8)
    assert [s.request_id for s in got[0].samples] == [("a", 0), ("a", 1), ("a", 2)]


def test_forked_samples_that_guess_each_equal_generate():
    """Fork and speculative decoding together: the runner and its step carry both (the forks of a prompt,
    each row's guesses), and every greedy sample of a repetitive prompt guesses and equals generate."""
    model = tiny_model("llama")
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 8, 9, 8, 9], [3, 4] * 4]
    eng = Engine(model, max_batch_size=6, kv="paged", block_size=2, parallel_sampling="fork", speculative="ngram")
    got = eng.run([Request(p, 8, ignore_eos=True, sampling_params=SamplingParams(n=2)) for p in prompts])
    for p, c in zip(prompts, got):
        assert [s.output_ids for s in c.samples] == [reference(model, p, 8, eos_id=None)] * 2, p
    assert eng.spec_stats["accepted"] > 0
    _no_leak(eng)


@pytest.mark.parametrize("block_size,prompt", [(4, PROMPT), (4, PROMPT[:4]), (1, PROMPT), (16, PROMPT)])
@pytest.mark.parametrize("kv", ["paged", "concat"])
@pytest.mark.parametrize("mode", MODES)
def test_seeded_samples_each_equal_the_sample_run_alone(block_size, prompt, kv, mode):
    model = tiny_model("llama")
    options = dict(kv=kv, block_size=block_size)
    params = SamplingParams(temperature=1.0, seed=11, n=3)
    eng = Engine(model, parallel_sampling=mode, max_batch_size=4, **options)
    got = eng.run([Request(prompt, 12, sampling_params=params, ignore_eos=True)])[0]
    assert [s.output_ids for s in got.samples] == [_alone(model, prompt, 12, 11, i, **options) for i in range(3)]
    assert len({tuple(s.output_ids) for s in got.samples}) > 1  # they are different samples
    if kv == "paged":
        _no_leak(eng)


def test_samples_share_the_prompt_blocks_and_copy_only_on_write():
    model = tiny_model("qwen2")
    params = SamplingParams(temperature=1.0, seed=3, n=4)
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, parallel_sampling="fork")
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
@pytest.mark.parametrize("mode", MODES)
def test_preempting_one_sample_leaves_its_siblings_exact(preemption, mode):
    model = tiny_model("llama")
    params = SamplingParams(temperature=1.0, seed=5, n=3)
    eng = Engine(model, parallel_sampling=mode, max_batch_size=3, kv="paged", block_size=2, num_blocks=14, preemption=preemption)
    got = eng.run([Request(PROMPT, 14, sampling_params=params, ignore_eos=True)])[0]
    assert any(r.preempted for r in eng.records), "the pool must be small enough to preempt a sample"
    options = dict(kv="paged", block_size=2)
    assert [s.output_ids for s in got.samples] == [_alone(model, PROMPT, 14, 5, i, **options) for i in range(3)]
    _no_leak(eng)


def test_forked_samples_wait_for_room_for_all_of_them():
    model = tiny_model("gpt2")
    eng = Engine(model, max_batch_size=3, kv="paged", block_size=4, parallel_sampling="fork")
    reqs = [Request([20, 21, 22], 6, request_id="one"), Request(PROMPT, 6, request_id="n", sampling_params=SamplingParams(n=3))]
    got = eng.run(reqs)
    assert max(len(r.seqs) for r in eng.records) <= 3
    assert [s.output_ids for s in got[1].samples] == [reference(model, PROMPT, 6)] * 3
    assert got[0].output_ids == reference(model, [20, 21, 22], 6)


@pytest.mark.parametrize("mode", MODES)
def test_aborting_a_request_aborts_every_sample_and_frees_the_blocks(mode):
    model = tiny_model("llama")
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, token_budget=2, parallel_sampling=mode)
    eng.add_request(Request(PROMPT, 8, request_id="x", sampling_params=SamplingParams(n=3)))
    eng.step()  # the prompt is still being prefilled: the other samples have not forked yet
    done = eng.abort("x")
    assert done.finish_reason == "aborted" and [s.finish_reason for s in done.samples] == ["aborted"] * 3
    assert not eng.has_unfinished()
    _no_leak(eng)
    eng.add_request(Request(PROMPT, 8, request_id="y", sampling_params=SamplingParams(n=2)))
    step_until(eng, lambda: eng.sequences[("y", 1)].output_ids, "sample 1 decoding")
    assert eng.abort("y").samples[1].output_ids  # decoding when aborted
    _no_leak(eng)


@pytest.mark.parametrize("mode", MODES)
def test_a_stream_reports_every_sample(mode):
    model = tiny_model("qwen2")
    eng = Engine(model, parallel_sampling=mode, max_batch_size=4, kv="paged")
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
    eng = Engine(model, max_batch_size=2, parallel_sampling="fork")
    with pytest.raises(ValueError, match="n=3 samples.*max_batch_size"):
        eng.add_request(Request(PROMPT, 4, sampling_params=SamplingParams(n=3)))
    # fanout's samples take turns: three of them through a batch of two
    got = Engine(model, max_batch_size=2).run([Request(PROMPT, 4, sampling_params=SamplingParams(n=3))])[0]
    assert [s.output_ids for s in got.samples] == [reference(model, PROMPT, 4)] * 3
    with pytest.raises(ValueError, match="static batching runs one sample"):
        static_batching(model, None, [Request(PROMPT, 4, sampling_params=SamplingParams(n=2))], batch_size=2)
    with pytest.raises(ValueError, match="n > 1"):
        DisaggregatedServer(model).run([Request(PROMPT, 4, sampling_params=SamplingParams(n=2))])


@pytest.mark.parametrize("mode", MODES)
def test_aborting_one_sample_before_it_forked_keeps_it_aborted(mode):
    model = tiny_model("llama")
    eng = Engine(model, parallel_sampling=mode, max_batch_size=4, kv="paged", block_size=4)
    eng.add_request(Request(list(range(10, 20)), 6, request_id="r", ignore_eos=True, sampling_params=SamplingParams(n=3)))
    assert eng.abort(("r", 1)).finish_reason == "aborted"
    eng.run([])
    samples = eng.completions["r"].samples
    assert [(s.finish_reason, len(s.output_ids)) for s in samples] == [("length", 6), ("aborted", 0), ("length", 6)]
    assert samples[2].output_ids == reference(model, list(range(10, 20)), 6)
    _no_leak(eng)


@pytest.mark.parametrize("mode", MODES)
def test_a_sample_id_cannot_be_taken_by_another_request(mode):
    eng = Engine(tiny_model("gpt2"), parallel_sampling=mode, max_batch_size=4, kv="paged", block_size=4)
    with pytest.raises(ValueError, match=r"duplicate id \('x', 1\) \(a sample of request 'x'\)"):
        eng.run([Request([1, 2, 3], 3, request_id=("x", 1)),
                 Request([7, 8, 9], 3, request_id="x", sampling_params=SamplingParams(n=2))])
    assert not eng.has_unfinished()


def test_fanout_children_share_full_prompt_blocks_through_the_prefix_cache():
    """vLLM V1: four children of one 11-token prompt (blocks of 4: two full, one partial) admitted in the
    same step; with prefix caching the three followers find the first child's two full blocks at once."""
    model = tiny_model("qwen2")
    params = SamplingParams(temperature=1.0, seed=3, n=4)
    prompt = list(range(10, 21))
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, prefix_caching=True)
    got = eng.run([Request(prompt, 6, sampling_params=params, ignore_eos=True)])[0]
    assert [s.num_cached_prompt_tokens for s in got.samples] == [0, 8, 8, 8]
    assert eng.records[0].num_prefill_tokens == 11 + 3 * 3  # the prompt once, then each child's last partial block
    assert eng.records[0].kv_usage["num_used_blocks"] == 2 + 4  # two shared full blocks, a partial block each
    options = dict(kv="paged", block_size=4)
    assert [s.output_ids for s in got.samples] == [_alone(model, prompt, 6, 3, i, **options) for i in range(4)]
    _no_leak(eng)


@pytest.mark.parametrize("seed", [0, 7])
def test_a_plugged_in_manager_that_cannot_share_blocks(seed):
    """The course's ReservingKVManager is a V1 manager (no fork, no copy on write): fork is refused up
    front; fanout's children need no sharing and come out exact."""
    model = tiny_model("llama")
    params = SamplingParams(temperature=1.0, seed=seed, n=3)
    fork = Engine(model, max_batch_size=4, kv="paged", block_size=1, num_blocks=200, parallel_sampling="fork",
                  kv_manager=ReservingKVManager(200))
    with pytest.raises(ValueError, match="cannot share blocks with copy on write.*fanout"):
        fork.add_request(Request(PROMPT, 8, sampling_params=params))
    assert not fork.has_unfinished()
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=1, num_blocks=200, kv_manager=ReservingKVManager(200))
    got = eng.run([Request(PROMPT, 8, sampling_params=params, ignore_eos=True)])[0]
    options = dict(kv="paged", block_size=1)
    assert [s.output_ids for s in got.samples] == [_alone(model, PROMPT, 8, seed, i, **options) for i in range(3)]
    assert eng.kv_usage()["num_used_blocks"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_aborting_one_sample_during_the_prompt_leaves_the_others_running(mode):
    model = tiny_model("llama")
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, token_budget=2, parallel_sampling=mode)
    eng.add_request(Request(PROMPT, 6, request_id="x", ignore_eos=True, sampling_params=SamplingParams(n=3)))
    eng.step()  # sample 0's prompt is still being prefilled
    assert eng.abort(("x", 0)).finish_reason == "aborted"
    eng.run([])
    samples = eng.completions["x"].samples
    assert [s.finish_reason for s in samples] == ["aborted", "length", "length"]
    assert [s.output_ids for s in samples[1:]] == [reference(model, PROMPT, 6)] * 2
    _no_leak(eng)


def test_the_progress_bar_counts_requests_with_samples(capsys):
    model = tiny_model("gpt2")
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4)
    eng.run([Request(PROMPT, 4, sampling_params=SamplingParams(n=3)), Request([20, 21], 3)], progress=True)
    assert "2/2" in capsys.readouterr().err


def test_fork_and_copy_on_write_live_in_a_subclass_built_only_for_fork():
    """V1's manager has no fork (V1 runs n > 1 as child requests); the engine builds V0's forking
    manager only when parallel_sampling="fork" asks for it."""
    from cbteach.kv.fork import ForkingKVCacheManager, can_fork
    from cbteach.kv.manager import KVCacheManager
    model = tiny_model("gpt2")
    fanout = Engine(model, max_batch_size=2, kv="paged", block_size=4)
    fork = Engine(model, max_batch_size=2, kv="paged", block_size=4, parallel_sampling="fork")
    assert type(fanout.kv.manager) is KVCacheManager and type(fork.kv.manager) is ForkingKVCacheManager
    for name in ("fork", "take_pending_copies", "pending_copies", "num_cow_copies"):
        assert not hasattr(fanout.kv.manager, name), name
    assert not can_fork(fanout.kv.manager) and can_fork(fork.kv.manager)
    assert "num_cow_copies" not in fanout.kv_usage() and fork.kv_usage()["num_cow_copies"] == 0


def test_a_copy_that_does_not_fit_changes_nothing():
    """The copy's block counts like any other: with one free block short, allocate_slots refuses and
    leaves the tables, the reference counts, the free list and the pending copies as they were."""
    from types import SimpleNamespace
    from cbteach.kv.fork import ForkingKVCacheManager
    m = ForkingKVCacheManager(num_blocks=3, block_size=4, prefix_caching=True)
    parent = SimpleNamespace(request_id="p", block_table=[], num_computed_tokens=0, num_tokens=9,
                             token_ids=lambda a, b: list(range(a, b)))
    assert m.allocate_slots(parent, 6) == [0, 1]
    parent.num_computed_tokens = 6
    child = SimpleNamespace(request_id="c", block_table=[], num_computed_tokens=6, num_tokens=9,
                            token_ids=lambda a, b: list(range(a, b)))
    m.fork(parent, child)
    assert m.num_free_blocks == 1 and m.allocator.ref_counts[:2] == [2, 2]
    # 6 -> 9 tokens: the shared block 1 needs a copy (1 block) and token 9 a new one (1 block): 2 > 1 free
    before = (list(child.block_table), list(m.allocator.ref_counts), list(m.allocator.free_blocks))
    assert m.allocate_slots(child, 3) is None
    assert (list(child.block_table), list(m.allocator.ref_counts), list(m.allocator.free_blocks)) == before
    assert m.take_pending_copies() == [] and m.num_cow_copies == 0
    # 6 -> 8 tokens fits: the copy takes the last free block, and the parent keeps block 1 alone
    assert m.allocate_slots(child, 2) == []
    assert child.block_table == [0, 2] and m.allocator.ref_counts == [2, 1, 1]
    assert m.take_pending_copies() == [(1, 2)] and m.take_pending_copies() == []


def test_a_forking_subclass_that_replaces_allocate_slots_must_say_it_copies_on_write():
    from cbteach.kv.fork import ForkingKVCacheManager, can_fork

    class Mine(ForkingKVCacheManager):
        def allocate_slots(self, seq, num_new_tokens, new_computed_blocks=(), num_lookahead_tokens=0):
            return super().allocate_slots(seq, num_new_tokens, new_computed_blocks, num_lookahead_tokens)

    class MineSays(Mine):
        copy_on_write = True

    assert not can_fork(Mine(4, 4)) and can_fork(MineSays(4, 4))
