"""``python -m cbteach bench``: speed and memory, measured (notebook 07).

* :mod:`.measure` -- run engines on one workload, same tokens, and compare; the targets
* :mod:`.engines` -- the engines compared, each behind one function of the same shape
* :mod:`.experiments` -- notebook 07's experiments
* :mod:`.cli` -- the command line and its tables
"""
from .measure import (ALL_ENGINES, ENGINES, REFERENCE, clean, compare, headword_requests,  # noqa: F401
                      ideal_speedup, random_llama, run_engine, slot_steps, sweep, targets)
