"""What one step costs: a roofline over the step's plan, plus overheads and, for TP, the all-reduces.

One forward pass over a packed row of ``T`` tokens from ``S`` sequences must

* **read** every weight once (the whole model per step, whatever ``T``), every context token's K/V
  (attention reads each sequence's history) and write the new tokens' K/V;
* **compute** about ``2 x parameters`` FLOPs per token, plus attention's ``4 x heads x head_dim``
  FLOPs per (query, key) pair, plus the LM head for the sampled rows.

Which K/V and which pairs: a GPU's paged kernels read each context once and compute only the causal
pairs (the device's ``attention_layout="exact"``); the cbteach engine on a CPU attends padded groups
of sequences, and pays for the padding (``"groups"``, fitted with a cost per group:
:mod:`cbteach.sim.attention_work`) and, when a group's scores are too large for the caches
(:data:`SPILL_BYTES`), for writing and reading them through memory (the device's ``score_bandwidth``).

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
states. Each all-reduces a **payload** of ``m = tokens x hidden_size x dtype_bytes`` bytes (the tensor
every rank holds); NCCL's ring sends ``2 (tp - 1) / tp x m`` **wire bytes** per rank (a reduce-scatter
then an all-gather, each ``(tp - 1) / tp x m``) in ``2 (tp - 1)`` hops, so it costs
``2 (tp - 1) x link_latency + 2 (tp - 1) / tp x m / (link_bandwidth x link_efficiency)`` (the device's
topology, :mod:`~cbteach.sim.devices`). Each rank's GEMMs are 1/tp as wide, and narrow GEMMs reach a
smaller fraction of the peaks (``Device.tp_efficiency``). Pipeline stages, quantisation and CUDA
graphs are not modelled.

**Memory** is budgeted as vLLM V1 does (``Worker.determine_available_memory`` in
``vllm/v1/worker/gpu_worker.py``): the KV cache gets ``total x gpu_memory_utilization`` minus the peak
memory of a profiling forward pass -- the weights, the activations of a step of
``max_num_batched_tokens`` tokens -- and minus what was allocated outside torch (CUDA context, NCCL
buffers). :meth:`CostModel.memory_budget` states each term.
"""
from __future__ import annotations

from dataclasses import dataclass

from .attention_work import attention_work
from .coverage import Coverage
from .devices import Device, get_device
from .shapes import ModelShape, get_model


def ring_all_reduce_bytes(payload_bytes: float, world_size: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``payload_bytes`` over ``world_size`` ranks:
    ``N - 1`` chunks of ``payload / N`` in the reduce-scatter, as many in the all-gather."""
    return 2 * (world_size - 1) * payload_bytes / world_size


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
    comm_bytes: float  # wire bytes one rank sends into the step's all-reduces (ring: 2 (tp-1)/tp x payload)
    comm_payload: float = 0.0  # bytes of the all-reduced tensors (2 per layer, tokens x hidden x dtype each)
    attn_groups: int = 0  # attention calls per layer (groups of sequences attended together)
    score_bytes: float = 0.0  # score tensors too large for the caches, written and read (padded layouts)

    overlap: bool = True

    @property
    def total(self) -> float:
        kernels = max(self.compute, self.memory) if self.overlap else self.compute + self.memory
        return self.overhead + kernels + self.comm

    @property
    def bound(self) -> str:
        return "compute" if self.compute >= self.memory else "memory"


SPILL_BYTES = 64 * 2**20  # a score tensor (all heads of a layer) above this is charged at score_bandwidth


class CostModel:
    """Step times for ``model`` on ``device`` with ``tensor_parallel_size`` devices per replica.

    Call it with a plan (``cost(plan)``): it is a ``step_time`` for
    :class:`cbteach.core.clock.VirtualClock`."""

    def __init__(self, model, device, tensor_parallel_size: int = 1, block_size: int = 16):
        self.shape: ModelShape = get_model(model)
        self.device: Device = get_device(device)
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block_size must be a whole number >= 1, got {block_size!r}")
        self.block_size = block_size
        self.coverage = Coverage(self.device.calibrated_range)
        tp = tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"the tensor-parallel size (--tp) must be a whole number >= 1, got {tp!r}")
        s = self.shape
        if s.num_heads % tp or (s.num_kv_heads >= tp and s.num_kv_heads % tp) or (s.num_kv_heads < tp and tp % s.num_kv_heads):
            raise ValueError(f"--tp {tp}: {s.name}'s {s.num_heads} heads / {s.num_kv_heads} KV heads do not split "
                             f"over {tp} devices (heads must divide; KV heads divide or are replicated tp / kv_heads times)")
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

    NON_TORCH_BYTES = 0.5 * 2**30  # CUDA context and NCCL buffers per device (assumed: vLLM measures them)

    def memory_budget(self, gpu_memory_utilization: float = 0.9, max_num_batched_tokens: int | None = 2048,
                      max_num_seqs: int = 256) -> dict:
        """Each device's memory as vLLM V1 splits it (``vllm/v1/worker/gpu_worker.py``,
        ``determine_available_memory``: ``total x gpu_memory_utilization - peak``, the peak being
        the profiling run's torch peak plus non-torch allocations): bytes of ``total``, ``budget``,
        ``weights``, ``activations`` (a forward of ``max_num_batched_tokens`` tokens: the MLP's
        three intermediate-width tensors and a few hidden-width ones, per token; the sampler's fp32
        logits for ``max_num_seqs`` rows), ``non_torch`` (assumed) and what is left, ``kv_cache``."""
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        s, d, tp = self.shape, self.device, self.tp
        tokens = max_num_batched_tokens or s.max_positions
        per_token = 3 * s.intermediate_size / tp + 4 * s.hidden_size + (s.num_heads + 2 * s.num_kv_heads) * s.head_dim / tp
        activations = tokens * per_token * d.dtype_bytes + min(max_num_seqs, tokens) * s.vocab_size * 4
        non_torch = self.NON_TORCH_BYTES if d.name != "cpu" else 0.0
        budget = d.memory_bytes * gpu_memory_utilization
        kv = budget - self.weight_bytes_per_device - activations - non_torch
        return {"total": d.memory_bytes, "budget": budget, "weights": self.weight_bytes_per_device,
                "activations": activations, "non_torch": non_torch, "kv_cache": kv}

    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9, max_num_batched_tokens: int | None = 2048,
                           max_num_seqs: int = 256) -> int:
        """Tokens of K/V one replica holds: what :meth:`memory_budget` leaves each device for the KV
        cache, over one token's K/V on a device."""
        m = self.memory_budget(gpu_memory_utilization, max_num_batched_tokens, max_num_seqs)
        if m["kv_cache"] <= 0:
            gib = 2**30
            raise ValueError(f"{self.shape.name} does not fit on {self.tp} x {self.device.name}: of "
                             f"{m['budget'] / gib:.1f} GiB per device ({gpu_memory_utilization:g} of "
                             f"{m['total'] / gib:.1f} GiB), weights take {m['weights'] / gib:.1f}, activations "
                             f"{m['activations'] / gib:.1f} and CUDA/NCCL {m['non_torch'] / gib:.1f}, leaving no "
                             "room for K/V; use more devices (--tp)")
        return int(m["kv_cache"] // self.kv_bytes_per_token_per_device)

    # -- one step --------------------------------------------------------------------------------
    def step(self, num_computed_tokens, num_scheduled_tokens, num_logit_rows: int | None = None) -> StepCost:
        """The cost of one step feeding ``num_scheduled_tokens[i]`` tokens to sequence ``i``, which has
        ``num_computed_tokens[i]`` tokens cached (a plan's two lists). Attention is charged for what
        the device's ``attention_layout`` reads and computes (:mod:`cbteach.sim.attention_work`)."""
        s, d, tp = self.shape, self.device, self.tp
        T, S = sum(num_scheduled_tokens), len(num_scheduled_tokens)
        self.coverage.check(num_computed_tokens, num_scheduled_tokens)
        rows = S if num_logit_rows is None else num_logit_rows
        heads = max(s.num_heads // tp, 1)
        work = attention_work(num_computed_tokens, num_scheduled_tokens, d.attention_layout, self.block_size,
                              spill_pairs=SPILL_BYTES / (heads * d.dtype_bytes))
        score_bytes = 2 * s.num_layers * heads * d.dtype_bytes * work.spilled  # written, then read by the softmax
        dense = (2 * T * s.num_layers * s.layer_params + 2 * rows * s.hidden_size * s.vocab_size) / tp
        attn = 4 * s.num_layers * s.num_heads * s.head_dim * work.pairs / tp
        eff = d.tp_efficiency(tp)
        compute = dense / (d.peak_flops * d.mfu * eff) + attn / (d.attn_flops or d.peak_flops * d.mfu * eff)
        kv = self.kv_bytes_per_token_per_device
        kv_bytes = kv * (work.read + T)  # K/V read, K/V written
        nbytes = self.weight_bytes_per_device + kv_bytes
        comm_bytes = comm = payload = 0.0
        if tp > 1:
            message = T * s.hidden_size * d.dtype_bytes  # one all-reduced tensor
            payload = 2 * s.num_layers * message
            comm_bytes = ring_all_reduce_bytes(payload, tp)  # a ring's wire bytes per rank
            comm = 2 * s.num_layers * 2 * (tp - 1) * d.link_latency + comm_bytes / (d.link_bandwidth * d.link_efficiency)
        overhead = d.step_overhead + S * d.seq_overhead + T * d.token_overhead + work.groups * d.group_overhead
        memory = (self.weight_bytes_per_device / (d.mem_bandwidth * d.mbu * eff)
                  + kv_bytes / (d.kv_bandwidth or d.mem_bandwidth * d.mbu * eff)
                  + (score_bytes / d.score_bandwidth if d.score_bandwidth else 0.0))
        return StepCost(compute=compute, memory=memory, comm=comm, overhead=overhead, flops=dense + attn,
                        attn_flops=attn, bytes=nbytes, comm_bytes=comm_bytes, comm_payload=payload, overlap=d.overlap,
                        attn_groups=work.groups, score_bytes=score_bytes)

    def step_time(self, num_computed_tokens, num_scheduled_tokens) -> float:
        return self.step(num_computed_tokens, num_scheduled_tokens).total

    def __call__(self, plan) -> float:
        """The cost of a step's :class:`~cbteach.core.scheduler_output.SchedulerOutput`."""
        starts = plan.num_computed_tokens_of()
        return self.step_time([starts[r] for r in plan.num_scheduled_tokens], list(plan.num_scheduled_tokens.values()))

    def __repr__(self) -> str:
        return f"CostModel({self.shape.name} on {self.tp} x {self.device.name})"
