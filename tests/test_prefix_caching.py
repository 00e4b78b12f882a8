"""Automatic prefix caching: shared prompt prefixes are computed once, and outputs stay exact."""
import math
import random

import pytest

from cbteach import Engine, Request
from cbteach.kv.memory import accounting
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
    # vLLM V1 makes a block findable when it is allocated: the second request, admitted in the same
    # step as the first, already shares its full prompt blocks (read in the same forward pass).
    assert cached[0] == 0
    assert all(c == (23 // block_size) * block_size for c in cached[1:])  # the shared full blocks
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


def test_speculative_steps_keep_their_blocks_findable():
    """Accepted guesses are among a sequence's tokens before its blocks are hashed: a chat turn that
    resends a speculating request's prompt and output finds all of it in the cache."""
    prompt = [7, 8, 9, 10] * 3  # repetitive: prompt lookup guesses right
    cached = {}
    for spec in (None, "ngram"):
        eng = Engine(MODEL, max_batch_size=2, kv="paged", block_size=4, num_blocks=64, prefix_caching=True,
                     **({"speculative": spec, "num_speculative_tokens": 3} if spec else {}))
        a = eng.run([Request(prompt, 40, ignore_eos=True, request_id="a")])[0]
        assert a.output_ids == reference(MODEL, prompt, 40, eos_id=-1)
        history = prompt + a.output_ids
        b = eng.run([Request(history, 2, ignore_eos=True, request_id="b")])[0]
        assert b.output_ids == reference(MODEL, history, 2, eos_id=-1)
        cached[spec] = b.num_cached_prompt_tokens
        if spec:
            assert eng.spec_stats["accepted"] > 0  # the guesses did land in the blocks
    assert cached["ngram"] == cached[None] == (len(history) - 1) // 4 * 4


def test_usage_counts_a_shared_block_once():
    eng = Engine(MODEL, max_batch_size=4, kv="paged", block_size=4, num_blocks=64, prefix_caching=True)
    system = list(range(10, 43))  # 33 tokens: 8 full blocks to share
    eng.run([Request(system, 2, request_id="warm", ignore_eos=True)])
    reqs = [Request(system + [i + 50], 20, request_id=f"s{i}", ignore_eos=True) for i in range(3)]
    for r in reqs:
        eng.add_request(r)
    for rec in drain(eng):
        u, bs = rec.kv_usage, eng.kv.block_size
        filled = {}  # block -> slots holding computed K/V, by hand
        for rid, table in u["block_tables"].items():
            n = u["seq_num_tokens"][rid]
            for i, b in enumerate(table):
                filled[b] = max(filled.get(b, 0), min(bs, max(0, n - i * bs)))
        assert u["num_tokens"] == sum(filled.values()) <= u["num_used_blocks"] * bs
        assert u["num_logical_tokens"] == sum(u["seq_num_tokens"].values()) >= u["num_tokens"]
        assert 0 <= u["internal_fragmentation"] and 0 <= u["utilisation"] <= 1
    assert any(len(r.kv_usage["block_tables"]) == 3 for r in eng.records[-25:])  # all three shared at once
    for m in accounting(eng):
        assert m.tokens_stored <= m.paged_slots
        assert m.tokens_per_region + m.contiguous_reserved + m.contiguous_internal == m.contiguous_slots
    for r in reqs:
        assert eng.completions[r.request_id].output_ids == reference(MODEL, r.prompt, 20, eos_id=-1)


def test_priority_preemption_never_evicts_for_blocks_that_stay_shared():
    """An urgent request may preempt less urgent ones only when that really makes room: blocks a
    victim shares with a request that stays (prefix caching) do not come free."""
    eng = Engine(MODEL, max_batch_size=3, kv="paged", block_size=4, num_blocks=7, watermark=0,
                 prefix_caching=True, policy="priority")
    system = list(range(10, 26))  # 16 tokens: 4 full blocks
    high = Request(system, 8, request_id="high", priority=0, ignore_eos=True)
    low = Request(system + [60], 6, request_id="low", priority=1, ignore_eos=True)  # shares those 4 blocks
    urgent = Request(list(range(70, 82)), 4, request_id="urgent", priority=0, ignore_eos=True)  # needs 3 blocks
    eng.add_request(high)
    eng.step()
    eng.add_request(low)
    eng.step()
    assert eng.sequences["low"].num_cached_prompt_tokens == 16
    # 6 blocks used: 4 shared, 1 of high's, 1 of low's. Free 1 + low's own 1 < 3: preempting low is useless.
    eng.add_request(urgent)
    rec = eng.step()
    assert rec.preempted == [] and "urgent" not in rec.admitted
    assert eng.sequences["low"].num_preemptions == 0
    for _ in drain(eng):
        pass
    for r in (high, low, urgent):
        assert eng.completions[r.request_id].output_ids == reference(MODEL, r.prompt, r.max_new_tokens, eos_id=-1)
