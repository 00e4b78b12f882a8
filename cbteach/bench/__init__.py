"""``python -m cbteach bench``: speed and memory, measured (notebook 07).

* :mod:`.measure` -- run engines on one workload, same tokens, and compare; the targets
* :mod:`.engines` -- the engines compared, each behind one function of the same shape
* :mod:`.experiments` -- notebook 07's experiments
* :mod:`.cli` -- the command line and its tables
* :mod:`.memory_experiments` -- a first-fit contiguous allocator plugged into the engine, fixed-budget runs (05)
"""
# The package's public API: what notebook 07 and tools/gpu_check.py call as ``bench.<name>``.
from .cli import print_table  # noqa: F401
from .experiments import (contiguous_batch_size, decode_step_times, headword_requests,  # noqa: F401
                          kv_bytes_per_token, machine_info, random_llama, step_time_vs_history)
from .measure import (ALL_ENGINES, ENGINES, REFERENCE, clean, compare, ideal_speedup, memory_bound,  # noqa: F401
                      run_engine, slot_steps, sweep, targets)
