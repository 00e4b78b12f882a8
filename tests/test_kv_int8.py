"""The int8 KV pool: a quarter of the memory, measured (not claimed exact) against the fp32 pool."""
import pytest
import torch

from cbteach import Engine, Request
from cbteach.kv.int8 import dequantize, quantize
from conftest import VOCAB, tiny_model


def test_quantisation_error_is_at_most_half_a_step():
    x = torch.randn(50, 3, 16, generator=torch.Generator().manual_seed(0)) * 4
    q, s = quantize(x)
    assert q.dtype == torch.int8 and s.shape == (50, 3)
    assert ((dequantize(q, s) - x).abs() <= s[..., None] / 2 + 1e-6).all()


def test_int8_pool_bytes_and_agreement_with_fp32(bierce):
    from cbteach.bierce.corpus import headword_prompts

    model, tok = bierce
    reqs = lambda: [Request(p, 40) for p in headword_prompts(12)]  # noqa: E731
    fp32 = Engine(model, tok, max_batch_size=4, kv="paged")
    int8 = Engine(model, tok, max_batch_size=4, kv="paged", kv_dtype="int8")
    assert int8.kv_usage()["kv_bytes_per_token"] <= 0.3 * fp32.kv_usage()["kv_bytes_per_token"]
    assert int8.kv_usage()["pool_bytes"] <= 0.3 * fp32.kv_usage()["pool_bytes"]
    a, b = fp32.run(reqs()), int8.run(reqs())
    same_first = sum(x.output_ids[:8] == y.output_ids[:8] for x, y in zip(a, b))
    assert same_first >= 9, f"only {same_first}/12 requests agree on their first 8 tokens"


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_int8_pool_under_preemption_and_prefix_caching_leaks_nothing(preemption):
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(2)
    reqs = [Request(torch.randint(6, VOCAB, (int(n),), generator=g).tolist(), int(m))
            for n, m in [(20, 30), (5, 40), (30, 10), (12, 25)]]
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, num_blocks=16, kv_dtype="int8",
                 preemption=preemption, prefix_caching=True)
    got = eng.run(reqs)
    assert all(len(c.output_ids) == r.max_new_tokens or c.finish_reason == "eos" for c, r in zip(got, reqs))
    assert eng.kv_usage()["num_free_blocks"] == eng.kv.num_blocks


def test_kv_memory_bytes_counts_int8_bytes_and_bad_kv_dtype_is_refused():
    model = tiny_model("llama")  # 2 layers, 2 KV heads of 16 dims: int8 = 2*2*2*(16+4) = 160 bytes/token
    eng = Engine(model, max_batch_size=2, kv="paged", block_size=8, kv_memory_bytes=160 * 8 * 10, kv_dtype="int8")
    assert eng.kv.num_blocks == 10
    with pytest.raises(ValueError, match="kv_dtype must be None"):
        Engine(model, max_batch_size=2, kv="paged", kv_dtype="int4")
    with pytest.raises(ValueError, match="kv_dtype needs kv='paged'"):
        Engine(model, max_batch_size=2, kv_dtype="int8")


def test_kv_loss_fp32_pool_is_the_models_loss_and_int8_changes_it_a_little(bierce):
    from cbteach.bierce.corpus import load_entries
    from cbteach.kv.loss import kv_loss

    model, tok = bierce
    ids = tok(" ".join(e["text"] for e in load_entries()[-3:]))["input_ids"][:200]
    with torch.no_grad():
        own = model(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    assert kv_loss(model, ids) == pytest.approx(own, abs=1e-4)
    int8 = kv_loss(model, ids, kv_dtype="int8")
    assert int8 != own and abs(int8 - own) < 0.05 * own


def test_block_scales_grow_and_requantise_earlier_tokens():
    from cbteach.kv.int8 import Int8BlockKVPool

    pool = Int8BlockKVPool(num_layers=1, num_blocks=3, block_size=4, num_kv_heads=2, head_dim=8)
    g = torch.Generator().manual_seed(0)
    small, big = torch.randn(3, 2, 8, generator=g), 10 * torch.randn(1, 2, 8, generator=g)
    slots = torch.tensor([4, 5, 6])  # block 1, offsets 0..2
    pool.write(0, slots, small, small)
    k, _ = pool.read_slots(0, slots)
    step = pool.k_scale[0][1].clone()
    assert torch.allclose(step, small.abs().amax(dim=(0, 2)) / 127)
    assert ((k - small).abs() <= step[None, :, None] / 2 + 1e-6).all()
    pool.write(0, torch.tensor([7]), big, big)  # a larger value: the block's scale grows
    grown = pool.k_scale[0][1].clone()
    assert (grown >= step).all() and (grown > step).any()
    k, _ = pool.read_slots(0, torch.tensor([4, 5, 6, 7]))
    both = torch.cat([small, big])
    # earlier tokens were rounded twice: within one new step of the truth (half for each rounding)
    assert ((k - both).abs() <= grown[None, :, None] + 1e-5).all()
    # a new owner starting the block at offset 0 forgets the old scale
    pool.write(0, torch.tensor([4]), small[:1], small[:1])
    assert torch.allclose(pool.k_scale[0][1], small[:1].abs().amax(dim=-1)[0] / 127)
    # read through a block table = read_slots of the same slots
    kb, _ = pool.read(0, torch.tensor([[1]]))
    assert torch.equal(kb[0, :1], pool.read_slots(0, torch.tensor([4]))[0])


def test_block_scales_use_less_memory_and_still_agree_with_fp32(bierce):
    from cbteach.bierce.corpus import headword_prompts

    model, tok = bierce
    reqs = lambda: [Request(p, 40) for p in headword_prompts(12)]  # noqa: E731
    per_token = Engine(model, tok, max_batch_size=4, kv="paged", kv_dtype="int8")
    per_block = Engine(model, tok, max_batch_size=4, kv="paged", kv_dtype="int8_block")
    assert per_block.kv_usage()["pool_bytes"] < per_token.kv_usage()["pool_bytes"]
    assert per_block.kv_usage()["kv_bytes_per_token"] <= 0.26 * 4 * model.config.hidden_size // \
        model.config.num_attention_heads * model.config.num_key_value_heads * 2 * model.config.num_hidden_layers
    a = Engine(model, tok, max_batch_size=4, kv="paged").run(reqs())
    b = per_block.run(reqs())
    same_first = sum(x.output_ids[:8] == y.output_ids[:8] for x, y in zip(a, b))
    assert same_first >= 9, f"only {same_first}/12 requests agree on their first 8 tokens"


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_block_scales_under_preemption_and_prefix_caching_leak_nothing(preemption):
    model = tiny_model("qwen2")
    g = torch.Generator().manual_seed(3)
    reqs = [Request(torch.randint(6, VOCAB, (int(n),), generator=g).tolist(), int(m))
            for n, m in [(20, 30), (5, 40), (30, 10), (12, 25), (20, 8)]]
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, num_blocks=16, kv_dtype="int8_block",
                 preemption=preemption, prefix_caching=True)
    got = eng.run(reqs)
    assert all(len(c.output_ids) == r.max_new_tokens or c.finish_reason == "eos" for c, r in zip(got, reqs))
    assert eng.kv_usage()["num_free_blocks"] == eng.kv.num_blocks


def test_kv_memory_bytes_counts_block_scales():
    model = tiny_model("llama")  # 2 layers, 2 KV heads of 16 dims: a block of 8 = 2*2*2*(16*8+4) = 1056 bytes
    eng = Engine(model, max_batch_size=2, kv="paged", block_size=8, kv_memory_bytes=1056 * 10, kv_dtype="int8_block")
    assert eng.kv.num_blocks == 10 and eng.kv_usage()["pool_bytes"] == 1056 * 10


def test_the_int8_pools_are_imported_only_for_int8_and_a_cache_refuses_a_pool_of_another_dtype():
    """The default path's paged cache names no int8 pool: kv/caches.py picks the pool for ``kv_dtype``,
    and a cache built by hand with a pool that stores another dtype is refused, not silently fp32. The
    default engine imports none of the KV variants' modules (int8, V0's host copies and watermark)."""
    import subprocess
    import sys
    from pathlib import Path

    from cbteach.core.config import CacheConfig
    from cbteach.kv.caches import pool_class
    from cbteach.kv.int8 import Int8BlockKVPool, Int8KVPool
    from cbteach.kv.paged import PagedKVCache
    from cbteach.kv.paged import PagedKVPool

    assert (pool_class(None), pool_class("int8"), pool_class("int8_block")) == (PagedKVPool, Int8KVPool, Int8BlockKVPool)
    shape = dict(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=2)
    with pytest.raises(ValueError, match="kv_dtype='int8' needs a pool that stores it"):
        PagedKVCache(CacheConfig(kind="paged", block_size=4, kv_dtype="int8"), **shape)
    with pytest.raises(ValueError, match="kv_dtype=None needs a pool that stores it"):
        PagedKVCache(CacheConfig(kind="paged", block_size=4), pool_cls=Int8KVPool, **shape)
    code = ("import sys\nfrom cbteach import Engine, Request\nfrom conftest import tiny_model\n"
            "Engine(tiny_model('gpt2'), max_batch_size=2, kv='paged', block_size=4).run([Request([1, 2, 3], 2)])\n"
            "print(sorted(m for m in ('cbteach.kv.int8', 'cbteach.kv.swap', 'cbteach.kv.watermark') if m in sys.modules))\n")
    root = Path(__file__).resolve().parent
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", f"the default engine imported a KV variant: {out.stdout}"
