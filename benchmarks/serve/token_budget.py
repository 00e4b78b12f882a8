"""Which token budget should ``cbteach serve`` use by default? Measured, over HTTP, at a few budgets.

For each budget (``none`` = every prompt prefilled in one step, the old default) a server is started
as a user starts it (``serve --port 0 --max-batch-size 16 --token-budget B``), and, alternating the
budgets round by round so that drift on a shared machine hits each of them:

* **the stall**: an innocent stream (an 8-token prompt, 160 tokens out) is running when one prompt of
  4,000 tokens arrives; we record the innocent stream's largest gap between two chunks (client clock)
  while the long prompt is in the engine, and the long request's own end-to-end latency;
* **throughput**: 48 requests from 16 clients, prompts of 16 to 3,000 tokens (log-normal, median
  ~300), 64 tokens out each: output tokens/s and the ITL p99 of the streams.

    .venv/bin/python benchmarks/serve/token_budget.py --rounds 3 --json benchmarks/serve/token-budget.json

Every server is killed in a ``finally``; the machine's processor count and load are recorded beside
the numbers (this machine is shared: read single rounds as noisy, the medians as rough).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LONG_PROMPT = 4000
INNOCENT = dict(prompt_len=8, max_tokens=160)


async def _stream(client, url, prompt, max_tokens, times: list, t0: float) -> float:
    """A streamed completion: the client-clock time of every chunk with tokens into ``times``; returns e2e."""
    import msgspec

    body = {"prompt": list(prompt), "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0.0}
    start = time.perf_counter()
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        buf = b""
        async for part in r.aiter_bytes():
            buf += part
            *done, buf = buf.split(b"\n\n")
            now = time.perf_counter() - t0
            for block in done:
                if block.startswith(b"data: {"):
                    event = msgspec.json.decode(block[6:])
                    if "error" in event:
                        raise RuntimeError(event["error"])
                    if any(c.get("text") for c in event.get("choices", [])):
                        times.append(now)
    return time.perf_counter() - start


async def stall(url: str, ids: list) -> dict:
    """The innocent stream's largest chunk gap while one 4,000-token prompt is in the engine."""
    import httpx

    async with httpx.AsyncClient(timeout=300) as client:
        t0 = time.perf_counter()
        times: list = []
        innocent = asyncio.ensure_future(_stream(client, url, ids[:INNOCENT["prompt_len"]], INNOCENT["max_tokens"],
                                                 times, t0))
        while len(times) < 10:
            await asyncio.sleep(0.005)
        sent = time.perf_counter() - t0
        long_times: list = []
        long_e2e = await _stream(client, url, ids[1000:1000 + LONG_PROMPT], 4, long_times, t0)
        ended = time.perf_counter() - t0
        await innocent
    during = [b - a for a, b in zip(times, times[1:]) if b >= sent and a <= ended]
    before = [b - a for a, b in zip(times[:10], times[1:10])]
    return {"max_gap_ms": 1000 * max(during), "median_gap_before_ms": 1000 * statistics.median(before),
            "long_e2e_ms": 1000 * long_e2e, "long_ttft_ms": 1000 * (long_times[0] - sent)}


def throughput(url: str, tok) -> dict:
    import numpy as np

    from cbteach.bench.endpoint import measure
    from cbteach.serving import workloads as wl

    rng = np.random.default_rng(0)
    lengths = wl.lognormal_lengths(48, 300.0, 1.0, 16, 3000, rng)
    prompts = wl.corpus_windows(tok, lengths, rng)
    work = wl.Workload("long-mix", prompts, [64] * len(prompts), ignore_eos=True)
    args = argparse.Namespace(model="bierce", api="completions", api_key=None, concurrency=16, timeout=600,
                              ttft_target=None, tpot_target=None)
    row = measure(url, work, args, tok)
    if row["num_failed"]:
        raise RuntimeError(f"{row['num_failed']} requests failed: {row['errors']}")
    return {"tokens_per_s": row["tokens_per_s"], "itl_p99_ms": 1000 * row["itl_p99"],
            "ttft_p50_ms": 1000 * row["ttft_p50"], "prompt_tokens": int(sum(lengths))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", default="none,128,256,512,1024,2048")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    from cbteach.models import load_model
    from cbteach.serving.server_launch import launch
    from cbteach.serving.workloads import corpus_ids

    tok = load_model("bierce")[1]
    ids = corpus_ids(tok)
    budgets = a.budgets.split(",")
    rows: dict = {b: [] for b in budgets}
    started = {"cpus": os.cpu_count(), "load_start": os.getloadavg()[0], "platform": platform.platform(),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for r in range(a.rounds):
        for b in (budgets if r % 2 == 0 else budgets[::-1]):
            server = launch(["--max-batch-size", "16", "--token-budget", b])
            try:
                asyncio.run(stall(server.url, ids))  # warm-up: the first long prefill pays for allocations
                row = {**asyncio.run(stall(server.url, ids)), **throughput(server.url, tok),
                       "load": os.getloadavg()[0]}
            finally:
                server.stop()
            rows[b].append(row)
            print(f"round {r} budget {b:>5}: " + ", ".join(f"{k} {v:.0f}" for k, v in row.items()), flush=True)
    table = {b: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for b, rs in rows.items()}
    print(f"\nmedians over {a.rounds} rounds ({started['cpus']} processors, load {started['load_start']:.1f} at "
          f"the start, {os.getloadavg()[0]:.1f} at the end):")
    print(f"{'budget':>7} {'max gap ms':>11} {'long e2e ms':>12} {'tokens/s':>9} {'ITL p99 ms':>11}")
    for b, m in table.items():
        print(f"{b:>7} {m['max_gap_ms']:>11.0f} {m['long_e2e_ms']:>12.0f} {m['tokens_per_s']:>9.0f} "
              f"{m['itl_p99_ms']:>11.0f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"machine": {**started, "load_end": os.getloadavg()[0]},
                                            "medians": table, "rounds": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
