"""Where a calibration belongs: the occasion it was measured on, and warnings when it is used on another.

A CPU step time depends on more than the code: the processor, the torch build and its number of
threads, and what else the machine is doing (on a shared 2-core machine the same step runs 1.5x
slower under load). A calibration is a measurement of one **occasion**, so a device file records it
(:func:`cbteach.sim.measure.machine_info`: platform, processor, CPUs, torch, threads, clock, load,
time) and so do measured runs. :func:`occasion_warnings` compares the two and says, in a sentence
each, what differs: a prediction made across occasions carries the machine's drift on top of the
model's error (on the reference machine, two occasions differed by 0.89x to 1.47x depending on the
workload -- not one factor a user could divide out). ``simulate validate`` prints them with its
errors; ``simulate run`` and ``capacity`` with a device file compare it with the machine at hand.
"""
from __future__ import annotations

import time

LOAD_GAP = 0.5  # load averages further apart than this, or 25% of the CPUs, count as different
HOURS_APART = 6.0  # measurements further apart in time are another occasion
_SAME = (("platform", "operating system and kernel"), ("processor", "processor"), ("cpus", "number of CPUs"),
         ("torch", "torch version"), ("torch_threads", "torch threads"))


def _hours(when: str) -> float | None:
    try:
        return time.mktime(time.strptime(when[:19], "%Y-%m-%d %H:%M:%S")) / 3600
    except (TypeError, ValueError):
        return None


def _clock(value) -> str:
    return "process" if "process" in str(value) else "wall"


def occasion_warnings(calibration: dict, machine: dict, what: str = "the runs") -> list[str]:
    """Sentences saying how ``machine`` (where ``what`` were measured, or the machine at hand) differs from
    the ``calibration``'s occasion; empty when nothing recorded differs. Fields either side lacks are
    not compared -- except that nothing recorded at all is said once."""
    if not calibration:
        return ["the device file does not record where it was calibrated: its error elsewhere is unknown"]
    if not machine:
        return [f"{what} do not record their machine, torch, threads or load: whether the calibration belongs to "
                "them cannot be checked"]
    out = []
    calibration, machine = _compat(calibration), _compat(machine)
    for key, name in _SAME:
        a, b = calibration.get(key), machine.get(key)
        if a is not None and b is not None and str(a) != str(b):
            out.append(f"{name}: calibrated with {a}, {what} with {b}")
    if calibration.get("clock") and machine.get("clock") and _clock(calibration["clock"]) != _clock(machine["clock"]):
        out.append(f"clock: calibrated on the {_clock(calibration['clock'])} clock, {what} on the "
                   f"{_clock(machine['clock'])} clock")
    la, lb = _load(calibration), _load(machine)
    cpus = calibration.get("cpus") or machine.get("cpus") or 1
    if la is not None and lb is not None and abs(la - lb) > max(LOAD_GAP, 0.25 * cpus):
        out.append(f"load: the machine's load average was {la:.2f} during the calibration and {lb:.2f} for {what}")
    ha, hb = _hours(calibration.get("when")), _hours(machine.get("when"))
    if ha is not None and hb is not None and abs(ha - hb) > HOURS_APART:
        out.append(f"time: calibrated {calibration['when']}, {what} measured {machine['when']} -- another occasion")
    return out


def _compat(info: dict) -> dict:
    """Older files name the platform ``machine``."""
    if "platform" not in info and isinstance(info.get("machine"), str):
        return {**info, "platform": info["machine"]}
    return info


def _load(info: dict) -> float | None:
    """The load average an occasion recorded (before, and after when there is one: their mean)."""
    vals = [info.get("load_before"), info.get("load_after")]
    vals = [v[0] if isinstance(v, (list, tuple)) else v for v in vals if v is not None]
    return sum(vals) / len(vals) if vals else None
