"""Serving around the engine (notebooks 06, 07, 09).

* :mod:`.metrics` -- TTFT, TPOT, ITL, E2E and goodput, vLLM's definitions
* :mod:`.workloads` -- seeded, offline request streams for benchmarks
* :mod:`.disagg` -- prefill and decode on two engines, simulated on one machine
"""
