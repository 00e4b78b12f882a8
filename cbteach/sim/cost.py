"""What one step costs: a roofline over the step's plan, plus overheads and, for TP, the all-reduces.

One forward pass over a packed row of ``T`` tokens from ``S`` sequences must

* **read** every weight once (the whole model per step, whatever ``T``), every context token's K/V
  (attention reads each sequence's history) and write the new tokens' K/V;
* **compute** about ``2 x parameters`` FLOPs per token, plus attention's ``4 x heads x head_dim``
  FLOPs per (query, key) pair, plus the LM head for the sampled rows.

On a device that reads ``B`` bytes/s and computes ``F`` FLOP/s, the step takes at least
``max(bytes / B, flops / F)`` -- the roofline (Williams et al., 2009; notebook 01), when reading and
computing overlap, as a GPU's kernels do (on this CPU the engine copies K/V blocks, then computes on
them: the two times add up -- the fitted ``"cpu"`` says so with ``overlap=False``). A decode step
of a few sequences is memory-bound (the weights dominate); a long prefill is compute-bound. Real
engines reach a fraction of both peaks (the device's ``mbu``, ``mfu``) and spend time outside the
kernels (scheduling, preparing inputs, sampling), modelled as ``step_overhead + S x seq_overhead +
T x token_overhead``.

**Tensor parallelism** over ``tp`` devices (Megatron-LM) divides the weights, the FLOPs and the K/V
heads by ``tp`` (a KV head is replicated when there are fewer KV heads than devices; embeddings
vocabulary-parallel, as vLLM shards them) and adds, per layer, two all-reduces of the step's hidden
states: a ring all-reduce of ``m`` bytes costs ``2 (tp - 1) / tp x m / link_bandwidth`` plus a
latency floor. Pipeline stages, quantisation and CUDA graphs are not modelled.
"""
from __future__ import annotations

from dataclasses import dataclass

from .devices import Device, get_device
from .shapes import ModelShape, get_model


@dataclass(frozen=True)
class StepCost:
    """One step's predicted seconds, by what they are spent on (the total is what the clock moves)."""

    compute: float
    memory: float
    comm: float
    overhead: float
    flops: float  # all of them, attention's included
    attn_flops: float
    bytes: float
    comm_bytes: float

    overlap: bool = True

    @property
    def total(self) -> float:
        kernels = max(self.compute, self.memory) if self.overlap else self.compute + self.memory
        return self.overhead + kernels + self.comm

    @property
    def bound(self) -> str:
        return "compute" if self.compute >= self.memory else "memory"


class CostModel:
    """Step times for ``model`` on ``device`` with ``tensor_parallel_size`` devices per replica.

    Call it with a plan (``cost(plan)``): it is a ``step_time`` for
    :class:`cbteach.core.clock.VirtualClock`."""

    def __init__(self, model, device, tensor_parallel_size: int = 1):
        self.shape: ModelShape = get_model(model)
        self.device: Device = get_device(device)
        tp = tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")
        s = self.shape
        if s.num_heads % tp or (s.num_kv_heads >= tp and s.num_kv_heads % tp) or (s.num_kv_heads < tp and tp % s.num_kv_heads):
            raise ValueError(f"{s.name}'s {s.num_heads} heads / {s.num_kv_heads} KV heads do not split over {tp} "
                             "devices (heads must divide; KV heads divide or are replicated tp / kv_heads times)")
        self.tp = tp

    # -- per-rank sizes ----------------------------------------------------------------------------
    @property
    def weight_bytes_per_device(self) -> float:
        return self.shape.num_params * self.device.dtype_bytes / self.tp

    @property
    def kv_bytes_per_token_per_device(self) -> float:
        """One token's K/V on one device: its share of the KV heads (at least one head)."""
        s = self.shape
        heads = max(s.num_kv_heads // self.tp, 1)
        return 2 * s.num_layers * heads * s.head_dim * self.device.dtype_bytes

    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9, activation_reserve: float = 0.05) -> int:
        """Tokens of K/V one replica holds: each device's memory (the fraction vLLM's
        ``gpu_memory_utilization`` allows, less a reserve for activations) after its weights."""
        free = self.device.memory_bytes * (gpu_memory_utilization - activation_reserve) - self.weight_bytes_per_device
        if free <= 0:
            raise ValueError(f"{self.shape.name} does not fit on {self.tp} x {self.device.name}: "
                             f"{self.weight_bytes_per_device / 1e9:.1f} GB of weights per device, "
                             f"{self.device.memory_bytes / 1e9:.0f} GB of memory; use more devices (tensor parallelism)")
        return int(free // self.kv_bytes_per_token_per_device)

    # -- one step --------------------------------------------------------------------------------
    def step(self, num_computed_tokens, num_scheduled_tokens, num_logit_rows: int | None = None) -> StepCost:
        """The cost of one step feeding ``num_scheduled_tokens[i]`` tokens to sequence ``i``, which has
        ``num_computed_tokens[i]`` tokens cached (a plan's two lists)."""
        s, d, tp = self.shape, self.device, self.tp
        T, S = sum(num_scheduled_tokens), len(num_scheduled_tokens)
        rows = S if num_logit_rows is None else num_logit_rows
        context = sum(c + n for c, n in zip(num_computed_tokens, num_scheduled_tokens))
        pairs = sum(n * c + n * (n + 1) / 2 for c, n in zip(num_computed_tokens, num_scheduled_tokens))  # causal
        dense = (2 * T * s.num_layers * s.layer_params + 2 * rows * s.hidden_size * s.vocab_size) / tp
        attn = 4 * s.num_layers * s.num_heads * s.head_dim * pairs / tp
        compute = dense / (d.peak_flops * d.mfu) + attn / (d.attn_flops or d.peak_flops * d.mfu)
        kv = self.kv_bytes_per_token_per_device
        nbytes = self.weight_bytes_per_device + kv * (context + T)  # weights, K/V read, K/V written
        comm_bytes = comm = 0.0
        if tp > 1:
            message = T * s.hidden_size * d.dtype_bytes
            comm_bytes = 2 * s.num_layers * message
            comm = 2 * s.num_layers * (d.link_latency + 2 * (tp - 1) / tp * message / d.link_bandwidth)
        overhead = d.step_overhead + S * d.seq_overhead + T * d.token_overhead
        kv_bytes = kv * (context + T)
        memory = self.weight_bytes_per_device / (d.mem_bandwidth * d.mbu) + kv_bytes / (d.kv_bandwidth or d.mem_bandwidth * d.mbu)
        return StepCost(compute=compute, memory=memory, comm=comm, overhead=overhead,
                        flops=dense + attn, attn_flops=attn, bytes=nbytes, comm_bytes=comm_bytes, overlap=d.overlap)

    def step_time(self, num_computed_tokens, num_scheduled_tokens) -> float:
        return self.step(num_computed_tokens, num_scheduled_tokens).total

    def __call__(self, plan) -> float:
        """The cost of a step's :class:`~cbteach.core.scheduler_output.SchedulerOutput`."""
        starts = plan.num_computed_tokens_of()
        return self.step_time([starts[r] for r in plan.num_scheduled_tokens], list(plan.num_scheduled_tokens.values()))

    def __repr__(self) -> str:
        return f"CostModel({self.shape.name} on {self.tp} x {self.device.name})"
