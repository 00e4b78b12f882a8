"""The engine's clock: wall time, or simulated seconds that move the same way on every machine.

Every time the engine records -- a request's arrival, its first token, each token after -- is read
from one clock. By default that is the wall clock (seconds since the engine was made). A
:class:`VirtualClock` is simulated time instead: it moves only when the engine tells it to, by

* ``advance(seconds)`` -- the engine waits for the next arrival by moving the clock there (no
  sleeping), and
* ``advance_step(plan, measured)`` -- after every forward pass, by the step's cost: what the step
  really took (``step_time=None``, a simulation of *this* machine), a fixed number of seconds
  (``step_time=0.01``: every step costs the same, so a workload lands on the same steps whatever the
  machine's speed -- what tests and exercise checks need), or a cost model's answer
  (``step_time=callable(plan) -> seconds``, as :mod:`cbteach.sim` does for a GPU we do not have).

Any object with ``__call__() -> float`` and ``advance(seconds)`` is a clock; ``advance_step`` is
optional (without it the engine calls ``advance(measured)``).
"""
from __future__ import annotations

import math
import numbers


class VirtualClock:
    """Simulated seconds: read by calling it, moved by :meth:`advance` and :meth:`advance_step`."""

    def __init__(self, t: float = 0.0, step_time=None):
        if step_time is not None and not callable(step_time) and (
                not isinstance(step_time, numbers.Real) or isinstance(step_time, bool)
                or not math.isfinite(step_time) or step_time < 0):
            raise ValueError(f"step_time must be None (what each step took), a number of seconds >= 0 or a "
                             f"function of the step's plan, got {step_time!r}")
        self.t = float(t)
        self.step_time = step_time

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += max(0.0, seconds)

    def advance_step(self, plan, measured: float) -> None:
        """One forward pass ran ``plan`` in ``measured`` real seconds: move by the step's cost."""
        if self.step_time is None:
            cost = measured
        elif callable(self.step_time):
            cost = float(self.step_time(plan))
        else:
            cost = self.step_time
        self.advance(cost)

    def __repr__(self) -> str:
        how = "as measured" if self.step_time is None else ("by a cost model" if callable(self.step_time)
                                                            else f"{self.step_time} s a step")
        return f"VirtualClock(t={self.t:.6g}, steps move it {how})"
