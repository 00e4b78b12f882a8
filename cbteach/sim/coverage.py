"""Where a calibration holds: the range of steps it measured, and the predicted steps beyond it.

A fitted device (``simulate calibrate``) is a straight line through the steps it measured. Inside their
range it interpolates; beyond it -- more sequences in a step, more tokens, longer contexts than any
calibrated step had -- it extrapolates, and on a CPU step times are not straight lines for long
(caches fill, matrix kernels change blocking). So a fit records its range (the largest calibrated
step in each dimension, :func:`range_of`) and every cost model built on it counts the steps it is
asked to predict beyond ``TOLERANCE`` times that range (:class:`Coverage`), by dimension.
``simulate validate`` and ``simulate run``/``capacity`` report the count and warn when it is more
than ``WARN_FRACTION`` of the steps.
"""
from __future__ import annotations

TOLERANCE = 1.1  # a step counts as outside when it exceeds the calibrated maximum by more than 10%
WARN_FRACTION = 0.05  # warn when more than 5% of the predicted steps are outside
DIMENSIONS = ("seqs", "tokens", "context")  # sequences in a step, tokens fed in it, longest context in it


def step_size(num_computed_tokens, num_scheduled_tokens) -> dict:
    """A step's size in each of :data:`DIMENSIONS`."""
    return {"seqs": len(num_scheduled_tokens), "tokens": sum(num_scheduled_tokens),
            "context": max((c + n for c, n in zip(num_computed_tokens, num_scheduled_tokens)), default=0)}


def range_of(steps) -> tuple:
    """The calibrated range of measured steps (dicts with ``"c"`` and ``"n"``), as a device keeps it."""
    top = dict.fromkeys(DIMENSIONS, 0)
    for step in steps:
        for k, v in step_size(step["c"], step["n"]).items():
            top[k] = max(top[k], v)
    return tuple((k, float(top[k])) for k in DIMENSIONS)


class Coverage:
    """Counts the steps a cost model predicts, and those outside its device's calibrated range."""

    def __init__(self, calibrated_range=()):
        self.limits = dict(calibrated_range)
        self.reset()

    def reset(self) -> None:
        self.steps = 0
        self.outside = 0
        self.by = dict.fromkeys(self.limits, 0)

    def check(self, num_computed_tokens, num_scheduled_tokens) -> None:
        if not self.limits:
            return
        self.steps += 1
        size = step_size(num_computed_tokens, num_scheduled_tokens)
        beyond = [k for k, top in self.limits.items() if size.get(k, 0) > TOLERANCE * top]
        self.outside += bool(beyond)
        for k in beyond:
            self.by[k] += 1

    def report(self) -> dict:
        """``steps`` predicted, ``outside`` the range, their ``fraction``, ``by`` dimension, the ``range``;
        empty for a device with no calibrated range (the datasheet GPUs)."""
        if not self.limits:
            return {}
        return {"steps": self.steps, "outside": self.outside, "fraction": self.outside / self.steps if self.steps else 0.0,
                "by": dict(self.by), "range": dict(self.limits)}

    def warning(self) -> str | None:
        """A sentence when more than :data:`WARN_FRACTION` of the predicted steps were outside the range."""
        rep = self.report()
        if not rep or rep["fraction"] <= WARN_FRACTION:
            return None
        beyond = ", ".join(f"{k} (calibrated up to {rep['range'][k]:,.0f}): {v}" for k, v in rep["by"].items() if v)
        return (f"{rep['outside']} of {rep['steps']} predicted steps ({rep['fraction']:.0%}) lie outside the "
                f"calibrated range -- {beyond}; those are extrapolated: calibrate with the workload's shape "
                "(simulate calibrate --shape-of RUNS.json, or --max-batch/--max-tokens/--max-context)")
