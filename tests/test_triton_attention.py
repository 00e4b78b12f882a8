"""The Triton paged-attention kernel (:mod:`cbteach.attention.triton_unified`): equal to the reference
attention on random packed steps, and the engine on it gives ``generate``'s tokens.

Without a GPU the kernel runs in Triton's interpreter (``import cbteach`` chose it before Triton was
imported: :mod:`cbteach.attention.triton_mode`), so sizes stay small. Skipped where Triton is missing.
"""
from __future__ import annotations

import random
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbteach import Engine, Request
from cbteach.attention.metadata import build
from cbteach.attention.reference import reference_attention
from cbteach.kv.paged import PagedKVPool
from conftest import ARCHS, VOCAB, reference, tiny_model

triton_unified = pytest.importorskip("cbteach.attention.triton_unified",
                                     reason='Triton is not installed (pip install "cbteach[kernels]")')
if not triton_unified.INTERPRETED and not torch.cuda.is_available():
    pytest.skip("Triton was imported compiled on a machine without a GPU (TRITON_INTERPRET=0?)",
                allow_module_level=True)
DEVICE = "cpu" if triton_unified.INTERPRETED else "cuda"


def packed_step(seqs, block_size, heads, kv_heads, head_dim, seed=0):
    """A packed step of ``seqs`` (``[(num_computed_tokens, num_scheduled_tokens)]``) over a pool whose
    blocks are handed out shuffled; every slot no sequence owns up to its length holds NaN, so a
    kernel that reads one shows it. Returns the queries, the pool and the step's metadata."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(need) + 2
    pool = PagedKVPool(num_layers=1, num_blocks=num_blocks, block_size=block_size, num_kv_heads=kv_heads,
                       head_dim=head_dim, device=DEVICE)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, taken = [], 0
    for k in need:
        tables.append(order[taken:taken + k])
        taken += k
    for t in (pool.k[0], pool.v[0]):
        t.fill_(float("nan"))
    meta = build([1] * sum(n for _, n in seqs), [c for c, _ in seqs], [n for _, n in seqs], DEVICE,
                 block_tables=tables, block_size=block_size)
    for i, (c, n) in enumerate(seqs):  # each sequence's context, and nothing else, holds numbers
        pos = torch.arange(c + n)
        slots = torch.tensor(tables[i])[pos // block_size] * block_size + pos % block_size
        for t in (pool.k[0], pool.v[0]):
            t.view(-1, kv_heads, head_dim)[slots.to(DEVICE)] = torch.randn(c + n, kv_heads, head_dim, generator=g).to(DEVICE)
    meta.pool = pool
    query = torch.randn(1, heads, sum(n for _, n in seqs), head_dim, generator=g).to(DEVICE)
    return query, pool, meta


def assert_kernel_equals_reference(seqs, block_size, heads, kv_heads, head_dim, scaling=None, seed=0):
    query, pool, meta = packed_step(seqs, block_size, heads, kv_heads, head_dim, seed)
    got = triton_unified.unified_attention(query, pool.k[0], pool.v[0], meta, scaling)
    want = reference_attention(query, 0, meta, scaling)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


sequences = st.lists(st.tuples(st.integers(0, 300), st.integers(1, 20)), min_size=1, max_size=3)


@given(seqs=sequences, block_size=st.integers(1, 32), kv_heads=st.sampled_from([1, 2]),
       group=st.sampled_from([1, 2, 3]), head_dim=st.sampled_from([4, 8, 12, 16]),
       scaling=st.sampled_from([None, 0.3]), seed=st.integers(0, 2 ** 16))
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_the_kernel_equals_the_reference_on_random_packed_steps(seqs, block_size, kv_heads, group, head_dim,
                                                                 scaling, seed):
    assert_kernel_equals_reference(seqs, block_size, kv_heads * group, kv_heads, head_dim, scaling, seed)


@pytest.mark.parametrize("seqs, block_size, heads, kv_heads", [
    ([(5, 1), (16, 1), (0, 1), (31, 1)], 16, 4, 4),  # decodes only: a new block, a full one, a first token
    ([(3, 9), (14, 5)], 4, 4, 2),  # prefill chunks crossing block boundaries, a partly filled last block
    ([(0, 17), (7, 1), (2, 6)], 3, 6, 2),  # a block size that is no power of two, GQA, chunk + decode + prompt
    ([(250, 3), (0, 2)], 32, 2, 1),  # a long context over several tiles of keys
    ([(4, 2), (1, 1)], 1, 3, 1),  # one-token blocks
])
def test_the_kernel_on_chosen_steps(seqs, block_size, heads, kv_heads):
    assert_kernel_equals_reference(seqs, block_size, heads, kv_heads, 8)


def _tokens(model, prompts, max_new_tokens, **options):
    eng = Engine(model, attention="triton", kv="paged", **options)
    done = eng.run([Request(p, max_new_tokens, request_id=i, ignore_eos=True) for i, p in enumerate(prompts)])
    return eng, [c.output_ids for c in done]


@pytest.mark.parametrize("arch", ARCHS)
def test_the_engine_on_the_kernel_gives_generates_tokens_with_chunks_and_preemption(arch):
    model = tiny_model(arch)
    prompts = [[7, 8, 9, 10, 11, 12, 13], [12, 13], list(range(20, 37))]
    eng, got = _tokens(model, prompts, 6, max_batch_size=3, block_size=4, num_blocks=9, token_budget=8,
                       bucket_shapes=arch == "llama")  # CUDA's default: block tables padded to powers of two
    assert got == [reference(model, p, 6, eos_id=-1) for p in prompts]
    assert any(r.preempted for r in eng.records), "the pool is small enough to preempt"
    assert any(s.kind == "prefill" and s.num_computed_tokens > 0 for r in eng.records for s in r.seqs), \
        "a prompt was cut into chunks"


def test_the_engine_on_the_kernel_gives_generates_tokens_on_bierce(bierce):
    model, tok = bierce
    prompts = [tok(t)["input_ids"] for t in ("ABSURDITY, n.", "CYNIC, n. A blackguard")]
    eng = Engine(model, tok, max_batch_size=2, kv="paged", attention="triton")
    done = eng.run([Request(p, 5, request_id=i) for i, p in enumerate(prompts)])
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=5)
        expected.append(out[0, len(p):].tolist())
    assert [c.output_ids[:len(e)] for c, e in zip(done, expected)] == expected


def test_the_kernel_with_prefix_caching_and_ngram_speculation():
    model = tiny_model("qwen2")
    g = random.Random(1)
    system = [g.randrange(6, VOCAB) for _ in range(9)]
    motif = [g.randrange(6, VOCAB) for _ in range(3)]
    prompts = [system + motif * 3 + [g.randrange(6, VOCAB)] for _ in range(3)]
    eng, got = _tokens(model, prompts, 6, max_batch_size=2, block_size=4, prefix_caching=True,
                       speculative="ngram", num_speculative_tokens=3)
    assert got == [reference(model, p, 6, eos_id=-1) for p in prompts]
    assert eng.kv.manager.prefix_cache.hits > 0 and eng.spec_stats["drafted"] > 0


def test_what_the_kernel_cannot_do_is_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="kv='paged'"):
        Engine(model, max_batch_size=2, attention="triton")
    with pytest.raises(ValueError, match="kv_dtype='int8'"):
        Engine(model, max_batch_size=2, kv="paged", kv_dtype="int8", attention="triton")
    with pytest.raises(ValueError, match="a function or 'triton'"):
        Engine(model, max_batch_size=2, kv="paged", attention="cuda")
    if triton_unified.INTERPRETED:  # NumPy has no bfloat16: refused, never wrong tokens
        with pytest.raises(ValueError, match="no bfloat16"):
            Engine(tiny_model("llama").to(torch.bfloat16), max_batch_size=2, kv="paged", attention="triton")


def test_without_triton_the_error_says_how_to_install_it(monkeypatch):
    import cbteach.attention

    monkeypatch.setitem(sys.modules, "cbteach.attention.triton_unified", None)  # what `import` meets without Triton
    monkeypatch.delattr(cbteach.attention, "triton_unified")
    with pytest.raises(ValueError, match=r'pip install "cbteach\[kernels\]"'):
        Engine(tiny_model("gpt2"), max_batch_size=2, kv="paged", attention="triton")


def test_the_gpu_benchmark_times_three_ways_of_one_computation(capsys):
    """tools/gpu_check.py's kernel section (cbteach.bench.kernel_bench) compares like with like: here, on
    the CPU in fp32, the kernel, the gather and padded SDPA give the same outputs on its decode step."""
    import torch.nn.functional as F

    from cbteach.attention.paged import vectorised_attention
    from cbteach.bench import kernel_bench

    query, pool, meta, (k, v, mask) = kernel_bench.decode_step(3, 40, 4, 2, 16, dtype=torch.float32, device=DEVICE)
    kernel = triton_unified.unified_attention(query, pool.k[0], pool.v[0], meta)
    padded = F.scaled_dot_product_attention(query[0].transpose(0, 1)[:, :, None], k, v, attn_mask=mask,
                                            enable_gqa=True)  # [B, H, 1, D]
    torch.testing.assert_close(kernel, vectorised_attention(query, 0, meta), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kernel[0], padded[:, :, 0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    assert kernel_bench.datasheet_bandwidth("NVIDIA H200")[0] == "h200"
    assert kernel_bench.datasheet_bandwidth("NVIDIA L40S") is None  # not an L4
    if not torch.cuda.is_available():
        assert kernel_bench.run() == {} and "nothing measured" in capsys.readouterr().out
