"""The Triton paged-attention kernel against the gather and against SDPA, on a GPU (``tools/gpu_check.py``).

One layer's decode step, measured side by side in one run, for ``batch`` sequences with contexts of
``context // 2 .. context`` tokens in a paged pool:

* ``kernel`` -- :func:`cbteach.attention.triton_unified.unified_attention`: reads the pool in place;
* ``gather`` -- :func:`cbteach.attention.paged.vectorised_attention`: the engine's default (gathers
  each group's blocks, then ``scaled_dot_product_attention``);
* ``sdpa_padded`` -- ``scaled_dot_product_attention`` on K/V already contiguous and padded to the
  longest context: what a non-paged engine with a padded batch runs (no gather, but padding).

Each gives the step's median seconds (:func:`cbteach.perf.claims.timeit`, CUDA synchronised), decode
tokens per second (``batch / seconds``) and, for the kernel, the K/V bytes the step needs over its time
against the GPU's datasheet bandwidth (the roofline's ceiling; :mod:`cbteach.sim.devices`).
Nothing here runs without CUDA: in Triton's interpreter the timings would mean nothing.
"""
from __future__ import annotations

import random
import re

import torch
import torch.nn.functional as F

from ..attention.metadata import build
from ..attention.paged import vectorised_attention
from ..perf.claims import claim, timeit

# (name, heads, kv_heads, head_dim): bierce's attention, and TinyLlama-1.1B's (grouped-query, 32 on 4)
SHAPES = [("bierce", 6, 2, 32), ("llama_1b", 32, 4, 64)]


def decode_step(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size=16,
                dtype=torch.bfloat16, device="cuda", seed=0):
    """A decode step of ``batch`` sequences over a shuffled paged pool: ``(query, pool, meta, padded K/V)``."""
    from ..kv.paged import PagedKVPool

    rng = random.Random(seed)
    lens = [rng.randint(context // 2, context) for _ in range(batch)]
    need = [-(-n // block_size) for n in lens]
    pool = PagedKVPool(num_layers=1, num_blocks=sum(need), block_size=block_size, num_kv_heads=kv_heads,
                       head_dim=head_dim, dtype=dtype, device=device)
    pool.k[0].normal_()
    pool.v[0].normal_()
    order = list(range(sum(need)))
    rng.shuffle(order)
    tables, taken = [], 0
    for k in need:
        tables.append(order[taken:taken + k])
        taken += k
    meta = build([1] * batch, [n - 1 for n in lens], [1] * batch, device, block_tables=tables,
                 block_size=block_size, bucket_shapes=True)
    meta.pool = pool
    query = torch.randn(1, heads, batch, head_dim, dtype=dtype, device=device)
    k, v = pool.read(0, meta.block_tables)  # [B, width * block_size, kv_heads, D], made once, outside the timing
    pos = torch.arange(k.shape[1], device=device)
    mask = (pos[None, :] < meta.seq_lens[:, None])[:, None, None, :]  # [B, 1, 1, K]: the padding masked
    padded = (k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), mask)
    return query, pool, meta, padded


def measure(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, dtype=torch.bfloat16) -> dict:
    """Median seconds of one layer's decode attention for the kernel, the gather and padded SDPA."""
    from ..attention import triton_unified

    query, pool, meta, (k, v, mask) = decode_step(batch, context, heads, kv_heads, head_dim, dtype=dtype)
    q = query[0].transpose(0, 1)[:, :, None]  # [B, H, 1, D]
    runs = {"kernel": lambda: triton_unified.unified_attention(query, pool.k[0], pool.v[0], meta),
            "gather": lambda: vectorised_attention(query, 0, meta),
            "sdpa_padded": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)}
    out = {}
    for name, fn in runs.items():
        seconds = timeit(fn, repeats=30, warmup=5, sync=torch.cuda.synchronize)
        out[name] = {"seconds": seconds, "tokens_per_s": batch / seconds}
    context_bytes = int(meta.seq_lens.sum()) * 2 * kv_heads * head_dim * pool.k[0].element_size()
    out["kernel"]["kv_gb_per_s"] = context_bytes / out["kernel"]["seconds"] / 1e9
    return out


def datasheet_bandwidth(device_name: str) -> tuple[str, float] | None:
    """The datasheet memory bandwidth (bytes/s) of a GPU named like ``torch.cuda.get_device_name()``, from
    :data:`cbteach.sim.devices.DEVICES`; ``None`` for a GPU it does not list."""
    from ..sim.devices import DEVICES

    name = device_name.upper()
    for key, marker in (("h200", "H200"), ("h100", "H100"), ("a100-80gb", "A100-SXM4-80GB"), ("a100-80gb", "A100 80GB"),
                        ("a100-40gb", "A100"), ("l4", "L4"), ("t4", "T4")):
        if re.search(rf"\b{re.escape(marker)}\b", name):  # an L40S is no L4
            return key, DEVICES[key].mem_bandwidth
    return None


def run(batches=(16, 64), context: int = 1024) -> dict:
    """Every shape at every batch, printed as claims; the numbers, for the results JSON."""
    if not torch.cuda.is_available():
        print("kernel: no CUDA device here -- nothing measured (the interpreter's timings would mean nothing)")
        return {}
    results = {}
    peak = datasheet_bandwidth(torch.cuda.get_device_name())
    for name, heads, kv_heads, head_dim in SHAPES:
        for batch in batches:
            r = measure(batch, context, heads, kv_heads, head_dim)
            results[f"{name}/batch{batch}"] = r
            print(f"  {name} batch {batch}: " + ", ".join(f"{k} {1e6 * x['seconds']:.1f} us ({x['tokens_per_s']:,.0f} "
                                                         "tok/s)" for k, x in r.items())
                  + f"; the context's K/V over the kernel's time: {r['kernel']['kv_gb_per_s']:.0f} GB/s"
                  + (f" ({1e9 * r['kernel']['kv_gb_per_s'] / peak[1]:.0%} of the {peak[0]} datasheet's "
                     f"{peak[1] / 1e12:.2f} TB/s)" if peak else ""))
            claim(f"the kernel's decode step is faster than the gather's ({name}, batch {batch}, one layer)",
                  r["kernel"]["seconds"] < r["gather"]["seconds"])
            claim(f"the kernel's decode step is faster than SDPA on a padded batch ({name}, batch {batch}, one layer)",
                  r["kernel"]["seconds"] < r["sdpa_padded"]["seconds"])
    return results
