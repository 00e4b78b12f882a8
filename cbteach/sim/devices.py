"""Devices as data: memory, bandwidth, peak FLOPs and the link between devices, each with its source.

The roofline (notebook 01) needs two numbers per device -- how fast it reads memory and how fast it
multiplies -- plus, for tensor parallelism, how fast two devices exchange an all-reduce. The peak
figures below are the vendors' datasheet numbers (dense fp16/bf16 tensor-core FLOPs, HBM/GDDR
bandwidth, NVLink or PCIe per direction); no engine reaches them, so a cost model scales them by an
achieved fraction (``mfu``, ``mbu``: model FLOPs and memory-bandwidth utilisation) and adds a
fixed per-step overhead (scheduling, input preparation, sampling: Vidur models these CPU costs
apart from the kernels). Those four are **assumptions**, stated as such, until fitted: the device
``"cpu"`` is this machine, fitted on its own measured runs (:mod:`cbteach.sim.validate`).

Prices are illustrative on-demand cloud prices per GPU-hour (they change often: pass your own).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

GB = 1e9
TFLOPS = 1e12


@dataclass(frozen=True)
class Device:
    """One accelerator (or this CPU, fitted) as a cost model sees it."""

    name: str
    memory_bytes: float
    mem_bandwidth: float  # bytes/s, datasheet peak
    peak_flops: float  # FLOP/s, dense fp16/bf16 (fp32 for the CPU), datasheet peak
    link_bandwidth: float  # bytes/s per direction to a peer (NVLink, else PCIe)
    link_latency: float = 10e-6  # seconds per collective, on top of the bytes (NCCL's small-message floor)
    mfu: float = 0.6  # achieved fraction of peak FLOPs (assumed)
    mbu: float = 0.8  # achieved fraction of peak bandwidth (assumed)
    step_overhead: float = 3e-3  # seconds per step outside the kernels (assumed; fitted for the CPU)
    seq_overhead: float = 2e-5  # seconds per sequence in the step (assumed; fitted for the CPU)
    token_overhead: float = 0.0  # seconds per token fed (fitted for the CPU: packing, embedding, norms)
    attn_flops: float | None = None  # achieved FLOP/s of attention, if not peak x mfu (fitted for the CPU)
    kv_bandwidth: float | None = None  # achieved bytes/s of reading K/V, if not mem_bandwidth x mbu (fitted for the CPU)
    overlap: bool = True  # reads overlap compute (a GPU's kernels: the roofline's max); False: they add up
    dtype_bytes: int = 2  # bytes per weight and per K/V element
    price_per_hour: float = 0.0  # illustrative, per device
    source: str = ""

    def with_(self, **changes) -> Device:
        """A copy with some numbers changed (an assumption tested, a price of your own)."""
        return replace(self, **changes)


_NV = "NVIDIA datasheet: "
DEVICES: dict[str, Device] = {
    "t4": Device("t4", 16 * GB, 320 * GB, 65 * TFLOPS, 16 * GB, link_latency=20e-6, price_per_hour=0.35,
                 source=_NV + "Tesla T4 (16 GB GDDR6, 320 GB/s, 65 TFLOPS fp16 tensor; PCIe Gen3 x16)"),
    "l4": Device("l4", 24 * GB, 300 * GB, 121 * TFLOPS, 32 * GB, link_latency=20e-6, price_per_hour=0.80,
                 source=_NV + "L4 (24 GB GDDR6, 300 GB/s, 121 TFLOPS fp16 dense; PCIe Gen4 x16)"),
    "a100-40gb": Device("a100-40gb", 40 * GB, 1555 * GB, 312 * TFLOPS, 300 * GB, price_per_hour=1.80,
                        source=_NV + "A100 SXM4 40GB (1,555 GB/s HBM2, 312 TFLOPS fp16; NVLink 3: 600 GB/s "
                                     "both directions)"),
    "a100-80gb": Device("a100-80gb", 80 * GB, 2039 * GB, 312 * TFLOPS, 300 * GB, price_per_hour=2.20,
                        source=_NV + "A100 SXM4 80GB (2,039 GB/s HBM2e, 312 TFLOPS fp16; NVLink 3)"),
    "h100": Device("h100", 80 * GB, 3350 * GB, 989 * TFLOPS, 450 * GB, price_per_hour=3.00,
                   source=_NV + "H100 SXM5 (80 GB HBM3, 3.35 TB/s, 989 TFLOPS bf16 dense; NVLink 4: 900 GB/s "
                                "both directions)"),
    "h200": Device("h200", 141 * GB, 4800 * GB, 989 * TFLOPS, 450 * GB, price_per_hour=3.70,
                   source=_NV + "H200 SXM (141 GB HBM3e, 4.8 TB/s, 989 TFLOPS bf16 dense; NVLink 4)"),
}


def get_device(name) -> Device:
    """A device by name (:data:`DEVICES`), or a :class:`Device` passed through."""
    if isinstance(name, Device):
        return name
    key = str(name).lower()
    if key not in DEVICES:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(DEVICES)} (the CPU is fitted from its own "
                         "runs: cbteach.sim.validate.fit_cpu, or pass a Device)")
    return DEVICES[key]
