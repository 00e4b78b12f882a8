"""The paged KV cache: exact output for every block size, and the pool's invariants at every step."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbteach import Engine, Request
from cbteach.kv.manager import BlockAllocator, PoolExhausted
from cbteach.kv.memory import accounting, summary
from conftest import EOS, VOCAB, drain, reference, step_until, tiny_model

workloads = st.lists(
    st.tuples(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=64), st.integers(1, 128)),
    min_size=1, max_size=8)

_models = {}


def paged_model(arch):
    if arch not in _models:
        _models[arch] = tiny_model(arch)
    return _models[arch]


def check_invariants(eng):
    """Checked after every step: ownership, block counts, and the usage numbers."""
    owners = {}
    for seq in eng.scheduler.running:
        assert len(seq.block_table) == math.ceil(seq.num_computed_tokens / eng.kv.block_size), seq
        for b in seq.block_table:
            assert b not in owners, f"block {b} owned by {owners[b]} and {seq.request_id}"
            owners[b] = seq.request_id
    for seq in eng.scheduler.waiting:
        assert seq.block_table == []
    ref = eng.kv.manager.allocator.ref_counts
    assert sum(1 for c in ref if c > 0) == len(owners)
    usage = eng.kv_usage()
    assert usage["num_free_blocks"] == usage["num_blocks"] - len(owners)
    assert usage["num_tokens"] == sum(s.num_computed_tokens for s in eng.scheduler.running)
    assert usage["seq_num_tokens"] == {s.request_id: s.num_computed_tokens for s in eng.scheduler.running}
    assert 0.0 <= usage["utilisation"] <= 1.0


def run_checked(eng, reqs):
    for r in reqs:
        eng.add_request(r)
    step_until(eng, lambda: not eng.has_unfinished() and check_invariants(eng) is None, "every request to finish")
    usage = eng.kv_usage()
    assert usage["num_free_blocks"] == usage["num_blocks"], "blocks leaked"
    assert all(c == 0 for c in eng.kv.manager.allocator.ref_counts)
    return [eng.completions[r.request_id] for r in reqs]


# Each architecture with two of the three block sizes, each block size with two architectures (a Latin
# square less its diagonal: six runs, not nine -- the block size's arithmetic does not depend on the model).
@pytest.mark.parametrize("arch,block_size", [("llama", 1), ("llama", 4), ("qwen2", 4), ("qwen2", 16),
                                             ("gpt2", 16), ("gpt2", 1)])
@given(work=workloads, batch=st.integers(1, 8))
@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_paged_matches_generate(arch, block_size, work, batch):
    model = paged_model(arch)
    reqs = [Request(p, n) for p, n in work]
    eng = Engine(model, max_batch_size=batch, kv="paged", block_size=block_size)
    got = run_checked(eng, reqs)
    for c, r in zip(got, reqs):
        assert c.output_ids == reference(model, r.prompt, r.max_new_tokens)


@pytest.mark.parametrize("num_blocks", [14, 20, 40])
def test_small_pool_preempts_and_stays_exact(num_blocks):
    model = paged_model("llama")
    g = torch.Generator().manual_seed(3)
    reqs = [Request(torch.randint(6, VOCAB, (int(n),), generator=g).tolist(), int(m))
            for n, m in [(20, 30), (5, 40), (30, 10), (12, 25), (2, 35), (25, 20)]]
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, num_blocks=num_blocks)
    got = run_checked(eng, reqs)
    assert [c.output_ids for c in got] == [reference(model, r.prompt, r.max_new_tokens) for r in reqs]
    if num_blocks == 14:
        assert any(r.preempted for r in eng.records), "a 14-block pool must preempt this workload"


def test_kv_memory_bytes_sizes_the_pool():
    model = tiny_model("llama")
    # 2 layers x (K+V) x 2 kv heads x 16 dims x 4 bytes = 512 bytes per token
    eng = Engine(model, max_batch_size=2, kv="paged", block_size=8, kv_memory_bytes=512 * 8 * 10 + 100)
    assert eng.kv_usage()["num_blocks"] == 10
    assert eng.kv.pool.k[0].shape == (10, 8, 2, 16)


def test_allocator():
    a = BlockAllocator(2)
    b0, b1 = a.allocate(), a.allocate()
    with pytest.raises(PoolExhausted, match="all 2 KV blocks are in use"):
        a.allocate()
    a.take(b0)  # a second owner (a prefix-cache hit)
    a.release(b0)
    assert a.num_free == 0
    a.release(b0)
    a.release(b1)
    assert a.num_free == 2 and a.ref_counts == [0, 0]
    with pytest.raises(ValueError, match="released twice"):
        a.release(b0)


def test_usage_and_accounting_numbers():
    model = tiny_model("gpt2")
    eng = Engine(model, max_batch_size=3, kv="paged", block_size=4)
    reqs = [Request([7] * 5, 3), Request([8] * 9, 6), Request([9], 2)]
    for r in reqs:
        eng.add_request(r)
    rec = eng.step()  # all three prefill: 5, 9 and 1 tokens -> 2 + 3 + 1 blocks
    u = rec.kv_usage
    assert (u["num_used_blocks"], u["num_tokens"]) == (6, 15)
    assert u["utilisation"] == pytest.approx(15 / 24)
    assert u["internal_fragmentation"] == 24 - 15
    drain(eng)
    steps = accounting(eng)
    first = steps[0]
    assert first.contiguous_slots == (5 + 3) + (9 + 6) + (1 + 2)
    assert first.tokens_stored == 15
    for m in steps:
        assert m.tokens_per_region == m.tokens_stored  # no prefix sharing here
        assert m.tokens_stored + m.contiguous_reserved + m.contiguous_internal == m.contiguous_slots
        assert m.contiguous_reserved >= 0 and m.contiguous_internal >= 0
    # every request is live on step 0, so its whole never-generated tail counts as internal there
    assert first.contiguous_internal == sum(r.max_new_tokens - len(eng.completions[r.request_id].output_ids)
                                            for r in reqs)
    s = summary(steps)
    assert 0 < s["contiguous_utilisation"] <= s["paged_utilisation"] <= 1
    for wrong in (None, eng.records):
        with pytest.raises(ValueError, match="takes the Engine itself"):
            accounting(wrong)
    assert s["contiguous_utilisation"] + s["contiguous_reserved_fraction"] + s["contiguous_internal_fraction"] \
        == pytest.approx(1.0)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_model_is_left_as_it_was_found(attn):
    """The paged engine switches attention only during its steps: afterwards the model is the user's again."""
    model = tiny_model("qwen2", attn)
    before = reference(model, [7, 8, 9], 10)
    Engine(model, max_batch_size=2, kv="paged").run([Request([7, 8, 9], 10)])
    assert model.config._attn_implementation == attn
    assert reference(model, [7, 8, 9], 10) == before


def test_transformers_continuous_batching_works_after_a_paged_engine():
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = tiny_model("llama")
    prompts = [[7, 8, 9], [10, 11]]
    Engine(model, max_batch_size=2, kv="paged").run([Request(p, 8) for p in prompts])
    gen = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=EOS, pad_token_id=EOS)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=16, max_requests_per_batch=2, max_batch_tokens=64)
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                               progress_bar=False, warmup=False)
    got = sorted(o.generated_tokens for o in out.values())
    assert got == sorted(reference(model, p, 8) for p in prompts)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_the_written_out_attention_a_gpu_runs_gives_generates_tokens(arch, monkeypatch):
    """On a GPU the engine's paged attention does not hand its boolean masks to a fused SDPA kernel: it
    computes ``softmax(q kᵀ * scale, where mask) v`` itself (``masked_softmax_attention``), because the
    kernel an H200 picked gave wrong tokens. Forced here on the CPU, on every layout a step meets
    (decodes laid out by KV head, chunked prefills, grouped-query and one KV head), it gives
    ``generate``'s tokens -- in the engine's attention and in the reference one."""
    from cbteach.attention import paged as paged_attention
    from cbteach.attention.reference import reference_attention

    model = tiny_model(arch)
    from cbteach.attention import reference as reference_module

    monkeypatch.setattr(paged_attention, "written_out", lambda device: True)
    monkeypatch.setattr(reference_module, "written_out", lambda device: True)
    reqs = [Request([3 + i, 9, 4, 7, 11, 5, 6][: 2 + i], 9, request_id=i, ignore_eos=True) for i in range(5)]
    for options in (dict(), dict(token_budget=5), dict(bucket_shapes=True)):
        outs = Engine(model, kv="paged", max_batch_size=3, block_size=4, **options).run(reqs)
        assert [o.output_ids for o in outs] == [reference(model, r.prompt, 9) for r in reqs], options
    def reference_on_the_pool(query, key, value, meta, layer, scaling):
        meta.pool.write(layer, meta.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))
        return reference_attention(query, layer, meta, scaling)

    outs = Engine(model, kv="paged", max_batch_size=3, block_size=4, attention=reference_on_the_pool).run(reqs)
    assert [o.output_ids for o in outs] == [reference(model, r.prompt, 9) for r in reqs]


def test_the_watermark_is_a_mixin_built_only_when_set():
    """V0's watermark lives in kv/watermark.py: the default manager keeps no room back; an engine with
    ``watermark`` builds a manager whose admissions leave that share of the pool free, and refuses up
    front a request that could not fit beside it."""
    from cbteach.core.request import Sequence
    from cbteach.kv.manager import KVCacheManager
    from cbteach.kv.watermark import Watermark, keeping_watermark

    model = paged_model("gpt2")
    plain = Engine(model, max_batch_size=2, kv="paged", block_size=4, num_blocks=8)
    assert type(plain.kv.manager) is KVCacheManager and not hasattr(plain.kv.manager, "watermark_blocks")
    eng = Engine(model, max_batch_size=2, kv="paged", block_size=4, num_blocks=8, admission="whole_prompt",
                 watermark=0.25)
    m = eng.kv.manager
    assert isinstance(m, Watermark) and isinstance(m, KVCacheManager) and m.watermark_blocks == 2
    assert type(m) is keeping_watermark(KVCacheManager)
    s = Sequence(request=Request([1, 2, 3], 2), prompt_ids=[1, 2, 3], arrival_time=0.0)
    assert m.num_admittable_tokens(s) == m.num_allocatable_tokens(s) - 2 * 4 == 6 * 4
    assert plain.kv.manager.num_admittable_tokens(s) == 8 * 4
    with pytest.raises(ValueError, match="watermark of 2"):
        eng.add_request(Request([1] * 26, 2))  # 7 blocks: fits the pool, not beside the watermark
    plain.add_request(Request([1] * 26, 2))
    reqs = [Request([1 + i] * 5, 6) for i in range(3)]
    assert [c.output_ids for c in eng.run(reqs)] == [reference(model, r.prompt, 6) for r in reqs]
