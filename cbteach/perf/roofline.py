"""Why decode is bandwidth-bound: FLOPs and bytes of one step, counted from a model's shape.

The **roofline** (Williams, Waterman and Patterson, *Roofline: An Insightful Visual Performance
Model for Multicore Architectures*, CACM 2009) says a computation that does ``F`` floating-point
operations and moves ``M`` bytes between memory and the chip takes at least
``max(F / peak_flops, M / bandwidth)`` seconds. Which term wins depends on its **arithmetic
intensity** ``I = F / M`` (FLOPs per byte) against the chip's **ridge point**
``peak_flops / bandwidth``: below the ridge a step waits for memory (*bandwidth-bound*), above it
for the arithmetic units (*compute-bound*).

One step of a decoder-only transformer, counted here:

* every weight matrix is read once per step, whatever the batch: ``weight_bytes``;
* every token fed multiplies by every matrix: 2 FLOPs (a multiply and an add) per weight per token;
* attention: each token's query meets ``n`` keys and mixes ``n`` values, ``4 * q_dim * n`` FLOPs per
  layer, and each sequence's keys and values are read from the KV cache: ``kv_bytes``.

A decode step feeds one token per sequence, so a batch of ``B`` does ``2 * params * B`` FLOPs for
``params * bytes_per_param`` bytes of weights: about ``B`` FLOPs per byte in 16-bit. A GPU's ridge is
in the hundreds, so decode at small batch is bandwidth-bound -- and batching is nearly free, the
reason continuous batching pays. The KV cache spoils the free lunch: its bytes grow with ``B``
too, so with long contexts the intensity levels off below the ridge and compute never takes over
(:func:`ridge_batch` returns ``None``). Apart from that, the KV cache must *fit*: the largest batch
the memory holds (:func:`kv_capacity_batch`) is often reached first -- **KV-capacity-bound**, a
limit on how many sequences can run, not on how fast a step is.

Counted: the matrix multiplies and attention's two products. Not counted: norms, RoPE, softmax,
activations, the embedding lookup (a gather of one row per token) -- a few percent of the FLOPs
and bytes of a large model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .claims import timeit


@dataclass(frozen=True)
class ModelShape:
    """What the arithmetic needs to know about a Llama-style model (gated MLP of three matrices)."""

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    intermediate: int
    vocab: int
    bytes_per_param: int = 2  # fp16 / bf16; fp32 is 4
    tied_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def kv_dim(self) -> int:
        """Width of one token's keys (or values) in one layer: fewer heads with grouped-query attention."""
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Weights of one layer's matrices: Q and O (hidden x hidden), K and V (hidden x kv_dim), MLP (3 x hidden x intermediate)."""
        return 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_dim + 3 * self.hidden * self.intermediate

    @property
    def matmul_params(self) -> int:
        """Weights every token is multiplied by: all layers plus the LM head (vocab x hidden)."""
        return self.num_layers * self.layer_params + self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        """All weights held in memory: the embedding table too, unless the LM head shares it."""
        return self.matmul_params + (0 if self.tied_embeddings else self.vocab * self.hidden)

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token in every layer."""
        return 2 * self.num_layers * self.kv_dim * self.bytes_per_param

    @classmethod
    def from_model(cls, model, name: str | None = None) -> "ModelShape":
        """The shape of a loaded transformers model (its config and its parameters' dtype)."""
        cfg = model.config
        heads = cfg.num_attention_heads
        return cls(name=name or getattr(cfg, "name_or_path", None) or type(model).__name__,
                   num_layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, num_heads=heads,
                   num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                   intermediate=cfg.intermediate_size, vocab=cfg.vocab_size,
                   bytes_per_param=next(model.parameters()).element_size(),
                   tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)))


# Llama-2-7B's shape (Touvron et al., 2023): multi-head attention (32 KV heads), fp16 weights.
LLAMA2_7B = ModelShape("Llama-2-7B shape", num_layers=32, hidden=4096, num_heads=32, num_kv_heads=32,
                       intermediate=11008, vocab=32000, bytes_per_param=2)


@dataclass(frozen=True)
class StepCost:
    """FLOPs and bytes of one forward step."""

    flops: float
    weight_bytes: float
    kv_bytes: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def intensity(self) -> float:
        """Arithmetic intensity: FLOPs per byte moved."""
        return self.flops / self.bytes

    def seconds_on(self, device: "Device") -> float:
        """The roofline's lower bound on the step's time: the slower of compute and memory."""
        return max(self.flops / device.peak_flops, self.bytes / device.bandwidth)

    def bound_on(self, device: "Device") -> str:
        return "compute-bound" if self.intensity >= device.ridge else "bandwidth-bound"


def _attention_flops(shape: ModelShape, query_key_pairs: int) -> float:
    """QK^T and softmax(QK^T)V: 2 FLOPs per multiply-add, ``q_dim`` of each per query-key pair, both products."""
    return 4.0 * shape.num_layers * shape.num_heads * shape.head_dim * query_key_pairs


def _check(name, value, least):
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


def decode_step(shape: ModelShape, batch: int, context: int) -> StepCost:
    """``batch`` sequences with ``context`` tokens cached each feed one new token.

    Each new query attends to ``context + 1`` keys (its own included); the KV cache moves the K/V of
    ``context + 1`` tokens per sequence (the cached ones read, the new one written)."""
    _check("batch", batch, 1)
    _check("context", context, 0)
    flops = 2.0 * shape.matmul_params * batch + _attention_flops(shape, batch * (context + 1))
    return StepCost(flops, float(shape.matmul_params * shape.bytes_per_param),
                    float(batch * (context + 1) * shape.kv_bytes_per_token))


def prefill_step(shape: ModelShape, prompt_len: int, batch: int = 1) -> StepCost:
    """``batch`` prompts of ``prompt_len`` tokens, nothing cached: every prompt token goes through every
    matrix (the LM head included), token ``i`` attends to ``i + 1`` keys, and the K/V of every prompt
    token is written once."""
    _check("prompt_len", prompt_len, 1)
    _check("batch", batch, 1)
    tokens = batch * prompt_len
    pairs = batch * prompt_len * (prompt_len + 1) // 2
    return StepCost(2.0 * shape.matmul_params * tokens + _attention_flops(shape, pairs),
                    float(shape.matmul_params * shape.bytes_per_param), float(tokens * shape.kv_bytes_per_token))


@dataclass(frozen=True)
class Device:
    """An accelerator's peak dense FLOP/s (in the dtype the model runs in), memory bandwidth and size."""

    name: str
    peak_flops: float
    bandwidth: float  # bytes per second
    memory_bytes: float | None = None
    source: str = ""

    @property
    def ridge(self) -> float:
        """The intensity (FLOPs per byte) above which a step is compute-bound on this device."""
        return self.peak_flops / self.bandwidth


# Published peaks (dense, no sparsity) from NVIDIA's datasheets: "NVIDIA T4 Tensor Core GPU",
# "NVIDIA A100 Tensor Core GPU" (SXM4 80GB) and "NVIDIA H100 Tensor Core GPU" (SXM5).
T4 = Device("T4 (Colab)", 65e12, 320e9, 16 * 2**30, "fp16 tensor cores, dense; fp32: 8.1 TFLOP/s")
A100 = Device("A100 SXM 80GB", 312e12, 2039e9, 80 * 2**30, "bf16 tensor cores, dense; fp32: 19.5 TFLOP/s")
H100 = Device("H100 SXM", 989e12, 3350e9, 80 * 2**30, "bf16 tensor cores, dense; fp32: 67 TFLOP/s")
DEVICES = (T4, A100, H100)


def ridge_batch(shape: ModelShape, device: Device, context: int, max_batch: int = 1 << 20) -> int | None:
    """The smallest decode batch whose intensity reaches ``device``'s ridge: where compute takes over.

    With ``f`` FLOPs and ``k`` KV bytes per sequence and ``W`` weight bytes, the intensity
    ``B f / (W + B k)`` grows with ``B`` towards ``f / k``. If that limit is below the ridge, no batch
    is compute-bound: ``None``."""
    _check("context", context, 0)
    one = decode_step(shape, 1, context)
    f, k, w, r = one.flops, one.kv_bytes, one.weight_bytes, device.ridge
    if f <= r * k:
        return None
    b = max(1, math.ceil(r * w / (f - r * k)))
    while b > 1 and decode_step(shape, b - 1, context).intensity >= r:  # floating-point safety, both ways
        b -= 1
    while decode_step(shape, b, context).intensity < r:
        b += 1
    return b if b <= max_batch else None


def kv_capacity_batch(shape: ModelShape, device: Device, context: int) -> int:
    """How many sequences of ``context + 1`` tokens fit in ``device``'s memory beside the weights."""
    _check("context", context, 0)
    if device.memory_bytes is None:
        raise ValueError(f"{device.name} has no memory size")
    free = device.memory_bytes - shape.total_params * shape.bytes_per_param
    return max(0, int(free // ((context + 1) * shape.kv_bytes_per_token)))


def _sync(device: torch.device):
    return torch.cuda.synchronize if device.type == "cuda" else None


def measure_flops(device="cpu", n: int = 512, dtype=torch.float32, repeats: int = 10) -> float:
    """FLOP/s of an ``n x n`` matmul on ``device`` (median of ``repeats`` after a warm-up): ``2 n^3`` FLOPs."""
    _check("n", n, 1)
    device = torch.device(device)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    seconds = timeit(lambda: torch.matmul(a, b, out=out), repeats=repeats, warmup=3, sync=_sync(device))
    return 2.0 * n**3 / seconds


def measure_bandwidth(device="cpu", nbytes: int = 64 * 2**20, repeats: int = 10) -> float:
    """Bytes/s of copying ``nbytes`` into another buffer on ``device``: each copy reads and writes ``nbytes``.

    Make ``nbytes`` larger than the CPU's caches, or the copy measures the cache, not the memory."""
    _check("nbytes", nbytes, 4)
    device = torch.device(device)
    src = torch.ones(nbytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = timeit(lambda: dst.copy_(src), repeats=repeats, warmup=2, sync=_sync(device))
    return 2.0 * src.nbytes / seconds


def measure_device(device="cpu", name: str = "this machine", **kwargs) -> Device:
    """This machine's roofline: measured matmul FLOP/s and copy bandwidth (``kwargs`` go to both)."""
    flops = measure_flops(device, **{k: v for k, v in kwargs.items() if k in ("n", "dtype", "repeats")})
    bandwidth = measure_bandwidth(device, **{k: v for k, v in kwargs.items() if k in ("nbytes", "repeats")})
    return Device(name, flops, bandwidth, None, f"measured on {torch.device(device).type}: matmul and copy")
