"""Devices as data: memory, bandwidth, peak FLOPs and the link between devices, each with its source.

The roofline (notebook 01) needs two numbers per device -- how fast it reads memory and how fast it
multiplies -- plus, for tensor parallelism, how fast devices exchange an all-reduce. The peak
figures below are the vendors' datasheet numbers (dense fp16/bf16 tensor-core FLOPs, HBM/GDDR
bandwidth, NVLink or PCIe per direction); no engine reaches them, so a cost model scales them by an
achieved fraction (``mfu``, ``mbu``: model FLOPs and memory-bandwidth utilisation) and adds a
fixed per-step overhead (scheduling, input preparation, sampling: Vidur models these CPU costs
apart from the kernels). Those are **assumptions**, stated as such, until fitted: the device
``"cpu"`` is fitted on this machine (:mod:`cbteach.sim.calibrate`, :mod:`cbteach.sim.validate`).

**Memory is counted in GiB**, as the driver counts it: an "80 GB" A100 or H100 reports 80 GiB
(``nvidia-smi``: 81,920 MiB on an A100-80GB, 85.9e9 bytes), and vLLM's budget is a fraction of that
total (:meth:`cbteach.sim.cost.CostModel.kv_capacity_tokens`).

**The link** is a topology: ``"nvlink"`` (every GPU of an HGX board reaches every other through
NVSwitch) or ``"pcie"`` (through the host's PCIe switches). NCCL's ring all-reduce over ``N`` devices
makes ``2 (N - 1)`` hops, each costing a latency ``link_latency`` (assumed: a few microseconds over
NVLink, more over PCIe), and sends ``2 (N - 1) / N`` of the payload per device at the bandwidth NCCL
reaches (``link_bandwidth`` x ``link_efficiency``, assumed).

Prices are illustrative on-demand cloud prices per GPU-hour (they change often: pass your own).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

LAYOUTS = ("exact", "groups", "buckets")  # what attention reads and computes (cbteach.sim.attention_work)
GB = 1e9
GIB = 2**30
MIB = 2**20
TFLOPS = 1e12


@dataclass(frozen=True)
class Device:
    """One accelerator (or this CPU, fitted) as a cost model sees it."""

    name: str
    memory_bytes: float  # what the driver reports as total (GiB-sized on GPUs)
    mem_bandwidth: float  # bytes/s, datasheet peak
    peak_flops: float  # FLOP/s, dense fp16/bf16 (fp32 for the CPU), datasheet peak
    link_bandwidth: float  # bytes/s per direction to a peer (NVLink, else PCIe), datasheet
    link_latency: float = 2e-6  # seconds per hop of a ring all-reduce (assumed)
    link: str = "nvlink"  # the topology: "nvlink" or "pcie"
    link_efficiency: float = 0.75  # fraction of link_bandwidth NCCL's ring reaches (assumed)
    mfu: float = 0.6  # achieved fraction of peak FLOPs (assumed)
    mbu: float = 0.8  # achieved fraction of peak bandwidth (assumed)
    tp_gemm_exponent: float = 0.1  # kernels at 1/N width reach mfu, mbu x N ** -exponent (assumed; 0: no loss)
    step_overhead: float = 3e-3  # seconds per step outside the kernels (assumed; fitted for the CPU)
    seq_overhead: float = 2e-5  # seconds per sequence in the step (assumed; fitted for the CPU)
    token_overhead: float = 0.0  # seconds per token fed (fitted for the CPU: packing, embedding, norms)
    attn_flops: float | None = None  # achieved FLOP/s of prefill attention, if not peak x mfu (fitted for the CPU)
    kv_bandwidth: float | None = None  # achieved bytes/s of reading K/V, if not mem_bandwidth x mbu (fitted)
    overlap: bool = True  # reads overlap compute (a GPU's kernels: the roofline's max); False: they add up
    attention_layout: str = "exact"  # what attention reads: "exact" (paged kernels), "groups"/"buckets" (cbteach's)
    group_overhead: float = 0.0  # seconds per attention group of a step (fitted for the CPU: calls per layer)
    score_bandwidth: float = 0.0  # bytes/s of writing and reading score tensors too large for the caches (fitted
    #                               for the CPU's padded groups, attention_work's "spilled"; 0: not charged)
    calibrated_range: tuple = ()  # ((what, largest calibrated), ...): steps beyond it are extrapolated
    dtype_bytes: int = 2  # bytes per weight and per K/V element
    price_per_hour: float = 0.0  # illustrative, per device
    source: str = ""

    def __post_init__(self):
        if self.attention_layout not in LAYOUTS:
            raise ValueError(f"attention layout must be one of {', '.join(LAYOUTS)}, got {self.attention_layout!r}")

    def with_(self, **changes) -> Device:
        """A copy with some numbers changed (an assumption tested, a price of your own)."""
        return replace(self, **changes)

    def tp_efficiency(self, tp: int) -> float:
        """The fraction of its one-device efficiency a kernel keeps when each rank's matrices are 1/tp as
        wide (narrower GEMMs fill fewer of the GPU's units per launch)."""
        return float(tp) ** -self.tp_gemm_exponent if tp > 1 else 1.0


_NV = "NVIDIA datasheet: "
_PCIE = dict(link="pcie", link_latency=5e-6)
DEVICES: dict[str, Device] = {
    "t4": Device("t4", 15360 * MIB, 320 * GB, 65 * TFLOPS, 16 * GB, price_per_hour=0.35, **_PCIE,
                 source=_NV + "Tesla T4 (16 GB GDDR6 = 15,360 MiB usable, 320 GB/s, 65 TFLOPS fp16 tensor; "
                              "PCIe Gen3 x16)"),
    "l4": Device("l4", 23034 * MIB, 300 * GB, 121 * TFLOPS, 32 * GB, price_per_hour=0.80, **_PCIE,
                 source=_NV + "L4 (24 GB GDDR6 = 23,034 MiB usable, 300 GB/s, 121 TFLOPS fp16 dense; PCIe Gen4 x16)"),
    "a100-40gb": Device("a100-40gb", 40 * GIB, 1555 * GB, 312 * TFLOPS, 300 * GB, price_per_hour=1.80,
                        source=_NV + "A100 SXM4 40GB (40 GiB HBM2, 1,555 GB/s, 312 TFLOPS fp16; NVLink 3: 600 GB/s "
                                     "both directions)"),
    "a100-80gb": Device("a100-80gb", 80 * GIB, 2039 * GB, 312 * TFLOPS, 300 * GB, price_per_hour=2.20,
                        source=_NV + "A100 SXM4 80GB (80 GiB HBM2e, 2,039 GB/s, 312 TFLOPS fp16; NVLink 3)"),
    "h100": Device("h100", 80 * GIB, 3350 * GB, 989 * TFLOPS, 450 * GB, price_per_hour=3.00,
                   source=_NV + "H100 SXM5 (80 GiB HBM3, 3.35 TB/s, 989 TFLOPS bf16 dense; NVLink 4: 900 GB/s "
                                "both directions)"),
    "h200": Device("h200", 143771 * MIB, 4800 * GB, 989 * TFLOPS, 450 * GB, price_per_hour=3.70,
                   source=_NV + "H200 SXM (141 GB HBM3e = 143,771 MiB as the driver reports it, 4.8 TB/s, "
                                "989 TFLOPS bf16 dense; NVLink 4)"),
}


def get_device(name) -> Device:
    """A device by name (:data:`DEVICES`), a :class:`Device` passed through, or a device file
    (``*.json``, written by ``python -m cbteach simulate calibrate``)."""
    if isinstance(name, Device):
        return name
    key = str(name).lower()
    if key.endswith(".json"):
        return load_device(name)
    if key not in DEVICES:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(DEVICES)}, or a device file (*.json) written "
                         "by `python -m cbteach simulate calibrate`, or a Device")
    return DEVICES[key]


def load_device(path) -> Device:
    """The :class:`Device` of a device file written by :func:`save_device` (``simulate calibrate``)."""
    try:
        data = json.loads(Path(path).read_text())
        d = data["device"]
        names = {f.name for f in fields(Device)}
        kept = {k: v for k, v in d.items() if k in names}
        kept["calibrated_range"] = tuple((str(k), float(v)) for k, v in kept.get("calibrated_range", ()))
        return Device(**kept)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a device file written by `python -m cbteach simulate calibrate` "
                         f"({type(err).__name__}: {err})") from None
