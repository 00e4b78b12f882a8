"""Automatic prefix caching: shared prompt prefixes are computed once, and outputs stay exact."""
import math
import random

import pytest
import torch

from cbteach import Engine, Request
from cbteach.kv.prefix_cache import PrefixCache, block_hashes
from conftest import VOCAB, reference, tiny_model

MODEL = tiny_model("qwen2")


def drain(eng):
    steps = 0
    while eng.has_unfinished():
        rec = eng.step()
        steps += 1
        assert steps < 5000
        ref = eng.kv.manager.allocator.ref_counts
        owners = {}
        for seq in eng.scheduler.running:
            assert len(seq.block_table) == math.ceil(seq.num_computed_tokens / eng.kv.block_size)
            for b in seq.block_table:
                owners[b] = owners.get(b, 0) + 1
        for b, n in owners.items():  # a shared block is counted once per owner
            assert ref[b] == n, f"block {b}: ref count {ref[b]}, owners {n}"
        assert sum(1 for c in ref if c) == len(owners)
        yield rec
    assert eng.kv.manager.num_free_blocks == eng.kv.num_blocks, "blocks leaked"
    assert all(c == 0 for c in eng.kv.manager.allocator.ref_counts)


def shared_prefix_requests(n=6, prefix_len=23, seed=0):
    g = random.Random(seed)
    system = [g.randrange(6, VOCAB) for _ in range(prefix_len)]
    return [Request(system + [g.randrange(6, VOCAB) for _ in range(g.randint(1, 6))], g.randint(3, 12),
                    request_id=i) for i in range(n)]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_shared_prefix_is_computed_once_and_outputs_are_exact(block_size):
    reqs = shared_prefix_requests()
    plain = Engine(MODEL, max_batch_size=2, kv="paged", block_size=block_size)
    eng = Engine(MODEL, max_batch_size=2, kv="paged", block_size=block_size, prefix_caching=True)
    for r in reqs:
        eng.add_request(r)
        plain.add_request(Request(r.prompt, r.max_new_tokens))
    fed = sum(rec.num_prefill_tokens for rec in drain(eng))
    fed_plain = sum(rec.num_prefill_tokens for rec in drain(plain))
    for r in reqs:
        c = eng.completions[r.request_id]
        assert c.output_ids == reference(MODEL, r.prompt, r.max_new_tokens)
    cached = [eng.completions[r.request_id].num_cached_prompt_tokens for r in reqs]
    assert cached[0] == 0 and cached[1] == 0  # the first two run together: nothing cached yet
    assert all(c == (23 // block_size) * block_size for c in cached[2:])  # the shared full blocks
    assert fed == fed_plain - sum(cached)
    usage = eng.kv_usage()
    assert usage["prefix_hits"] == sum(cached) and 0 < usage["prefix_hit_rate"] < 1


def test_an_identical_prompt_recomputes_only_its_last_token():
    prompt = list(range(6, 22))  # 16 tokens = 4 full blocks of 4
    eng = Engine(MODEL, max_batch_size=1, kv="paged", block_size=4, prefix_caching=True)
    a, b = eng.run([Request(prompt, 5), Request(prompt, 5)])
    assert a.output_ids == b.output_ids == reference(MODEL, prompt, 5)
    assert b.num_cached_prompt_tokens == 12  # 3 blocks: the 4th holds the last token, computed again
    first_b = next(rec for rec in eng.records if b.request_id in rec.admitted)
    assert [s.num_scheduled_tokens for s in first_b.seqs if s.request_id == b.request_id] == [4]


def test_evicted_blocks_are_forgotten_least_recently_used_first():
    eng = Engine(MODEL, max_batch_size=1, kv="paged", block_size=4, num_blocks=8, prefix_caching=True)
    g = random.Random(1)
    for i in range(12):  # far more distinct prompts than the pool holds
        p = [g.randrange(6, VOCAB) for _ in range(g.randint(5, 14))]
        c = eng.run([Request(p, 4)])[0]
        assert c.output_ids == reference(MODEL, p, 4)
    cache = eng.kv.manager.prefix_cache
    assert len(cache.block_of) <= 8 and len(cache.block_of) == len(cache.hash_of)
    assert all(cache.hash_of[b] == h for h, b in cache.block_of.items())


def test_prefix_caching_with_preemption_abort_and_swap_stays_exact():
    g = random.Random(7)
    system = [g.randrange(6, VOCAB) for _ in range(10)]
    for trial in range(30):
        preemption = g.choice(["recompute", "swap"])
        bs = g.choice([2, 4])
        reqs = [Request(system[:g.randint(0, 10)] + [g.randrange(6, VOCAB) for _ in range(g.randint(1, 5))],
                        g.randint(1, 16), request_id=f"{trial}-{i}") for i in range(g.randint(2, 6))]
        need = max(math.ceil((len(r.prompt) + r.max_new_tokens - 1) / bs) for r in reqs)
        eng = Engine(MODEL, max_batch_size=3, kv="paged", block_size=bs, num_blocks=need + g.choice([0, 2, 6]),
                     prefix_caching=True, preemption=preemption, token_budget=g.choice([None, 5]))
        for r in reqs:
            eng.add_request(r)
        victim = reqs[-1].request_id if trial % 3 == 0 else None
        for k, _ in enumerate(drain(eng)):
            if victim and k == 2 and not eng.sequences[victim].status.is_finished:
                eng.abort(victim)
        for r in reqs:
            c = eng.completions[r.request_id]
            want = reference(MODEL, r.prompt, r.max_new_tokens)
            assert c.output_ids == (want[:len(c.output_ids)] if c.finish_reason == "aborted" else want)


def test_block_hashes_chain_the_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    assert len(a) == 3  # the 7th token is a partial block
    b = block_hashes([9, 9, 3, 4], 2)
    assert a[1] != b[1]  # same tokens [3, 4], different prefix
    assert PrefixCache(2).lookup([1, 2]) == []


def test_prefix_caching_needs_the_paged_cache():
    with pytest.raises(ValueError, match="prefix_caching needs kv='paged'"):
        Engine(MODEL, max_batch_size=1, kv="concat", prefix_caching=True)


def test_block_hashes_are_stable_across_processes():
    import subprocess
    import sys

    code = "from cbteach.kv.prefix_cache import block_hashes; print(block_hashes(list(range(10)), 4))"
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(runs) == 1 and runs.pop().strip() == str(block_hashes(list(range(10)), 4))
