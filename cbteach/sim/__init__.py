"""The same scheduler at GPU and cluster scale, by simulation (notebook 13; ``python -m cbteach simulate``).

* :mod:`~cbteach.sim.shapes` and :mod:`~cbteach.sim.devices` -- models and devices as data, with sources;
* :mod:`~cbteach.sim.attention_work` -- what a step's attention reads and computes (exact, or padded groups);
* :mod:`~cbteach.sim.cost` -- a step's time: roofline, overheads, tensor parallelism's all-reduces;
* :mod:`~cbteach.sim.simulator` -- the engine's real scheduler and KV manager on simulated time;
* :mod:`~cbteach.sim.measure` -- measured runs of the real engine: the workloads, their steps and machine;
* :mod:`~cbteach.sim.validate` -- fitted on measured runs, its error on held-out ones;
* :mod:`~cbteach.sim.calibrate` -- a sweep of the real engine here covering a workload's shape, fitted;
* :mod:`~cbteach.sim.coverage` and :mod:`~cbteach.sim.occasion` -- where a calibration holds, and warnings;
* :mod:`~cbteach.sim.published` -- the GPU devices against published runs;
* :mod:`~cbteach.sim.roofline` -- the most a replica can serve of a workload, whatever the schedule;
* :mod:`~cbteach.sim.static` -- continuous vs static batching and the factors of the gap;
* :mod:`~cbteach.sim.capacity` -- the highest sustained rate within latency targets, GPUs, cost per token.
"""
from .cost import CostModel, StepCost  # noqa: F401
from .devices import DEVICES, Device, get_device  # noqa: F401
from .shapes import MODELS, ModelShape, get_model, shape_from_config  # noqa: F401
from .simulator import SimRequest, SimResult, simulate, synthetic_workload  # noqa: F401
