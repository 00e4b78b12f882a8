"""Issue 29's targets, measured side by side in one run: the server against the in-process engine, two
engine cores against one, a Poisson load, an independent client, and `transformers serve`.

    .venv/bin/python benchmarks/serve/run_serve_bench.py --rounds 3 --json benchmarks/serve/results-<N>cpu.json
    # optional, each from the package index, never committed here:
    #   --guidellm /path/to/guidellm-packages     (pip install --target DIR guidellm; torch & co. from .venv)
    #   --accelerate /path/to/accelerate-package  (pip install --no-deps --target DIR accelerate: transformers serve)

Every server is a subprocess started as a user starts it and killed in a ``finally``. The in-process and the
server runs alternate round by round (drift on a shared machine hits both), and each figure reported is the
median over rounds. The machine's processor count and load are recorded beside the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
ENV = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
WORK = dict(workload="headwords", requests=128, max_new_tokens=64)


def run(cmd, env=None, timeout=900) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, env=env or ENV, timeout=timeout, cwd=ROOT)
    if r.returncode not in (0, 1):
        raise RuntimeError(f"{' '.join(map(str, cmd[:6]))}... exited {r.returncode}:\n{r.stderr[-2000:]}")
    return r.stdout


class Server:
    """``python -m cbteach serve --port 0 ARGS`` (or another command), its URL read from what it prints."""

    def __init__(self, args, cmd=None, url=None, ready="/health", env=None):
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd or [PY, "-m", "cbteach", "serve", "--port", "0", *args], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env or ENV, cwd=ROOT, start_new_session=True)
        self.url, self.ready = url, ready

    def __enter__(self):
        import httpx

        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{Path(self.log.name).read_text()[-2000:]}")
            if self.url is None:
                found = re.search(r"serving \S+ on (http://\S+) ", Path(self.log.name).read_text())
                self.url = found.group(1) if found else None
            if self.url:
                try:
                    if httpx.get(self.url + self.ready, timeout=2).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
            time.sleep(0.3)
        self.__exit__()
        raise RuntimeError("server did not start")

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def bench_serve(url, concurrency, api="completions", model="bierce", **work) -> dict:
    w = {**WORK, **work}
    out = tempfile.mktemp(suffix=".json")
    cmd = [PY, "-m", "cbteach", "bench-serve", "--endpoint", url, "--api", api, "--model", model,
           "--workload", w["workload"], "--requests", str(w["requests"]), "--max-new-tokens", str(w["max_new_tokens"]),
           "--concurrency", str(concurrency), "--json", out]
    if "rate" in w:
        cmd += ["--rate", str(w["rate"])]
    run(cmd)
    return json.loads(Path(out).read_text())["rows"][0]


def in_process() -> dict:
    out = tempfile.mktemp(suffix=".json")
    run([PY, "-m", "cbteach", "bench", "--engines", "cbteach_paged", "--workload", WORK["workload"], "--requests",
         str(WORK["requests"]), "--max-new-tokens", str(WORK["max_new_tokens"]), "--max-batch-size", "16",
         "--history", "0", "--no-progress", "--json", out])
    return json.loads(Path(out).read_text())["engines"]["cbteach_paged"]


def guidellm(path, url, streams, model="bierce", out_tokens=64, requests=128) -> dict:
    out = tempfile.mktemp(suffix=".json")
    env = dict(ENV, PYTHONPATH=path)
    run([PY, "-m", "guidellm", "run", "--backend",
         f"kind=openai_http,target={url},model={model},request_format=/v1/completions",
         "--profile", f"kind=concurrent,streams={streams}",
         "--data", f"kind=synthetic_text,prompt_tokens=16,output_tokens={out_tokens}",
         "--constraint", f"kind=max_requests,count={requests}",
         "--tokenizer", f"kind=hf_auto,model={ROOT / 'cbteach' / 'bierce'}",
         "--output", f"kind=json,path={out}", "--disable-console"], env=env, timeout=1800)
    return _guidellm_summary(json.loads(Path(out).read_text()))


def _guidellm_summary(report) -> dict:
    """The few numbers we compare, from GuideLLM's JSON report (its names, its client's clock)."""
    b = report["benchmarks"][0]
    m = b["metrics"]

    def stat(name, key="successful"):
        d = m[name][key]
        return {"median": d.get("median"), "p99": (d.get("percentiles") or {}).get("p99"), "mean": d.get("mean")}
    return {"output_tokens_per_s": stat("output_tokens_per_second")["mean"],
            "ttft_ms": stat("time_to_first_token_ms"), "itl_ms": stat("inter_token_latency_ms"),
            "requests": m["request_totals"]}


def median(rows, key):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--guidellm", default=None, help="a folder with guidellm installed (pip install --target)")
    p.add_argument("--accelerate", default=None, help="a folder with accelerate (for transformers serve)")
    p.add_argument("--rounds-only", action="store_true", help="only the alternating rounds (no Poisson, no extras)")
    p.add_argument("--c16-only", action="store_true",
                   help="rounds of only the in-process engine and the one-core server at 16 clients, their order "
                        "alternated round by round (issue 37's target; implies --rounds-only)")
    p.add_argument("--busy", type=int, default=0,
                   help="load the machine with N busy-looping processes for the whole run (a loaded machine "
                        "made on purpose, the same every time; recorded in the JSON)")
    a = p.parse_args(argv)
    busy = [subprocess.Popen([PY, "-c", "while True: pass"]) for _ in range(a.busy)]
    try:
        return _main(a)
    finally:
        for b in busy:
            b.kill()
            b.wait()


def _main(a) -> int:
    out = {"machine": {"cpus": os.cpu_count(), "load_at_start": os.getloadavg(), "platform": platform.platform(),
                       "python": platform.python_version(), "busy_processes": a.busy}, "workload": WORK, "rounds": []}
    print(f"{os.cpu_count()} processors, load {os.getloadavg()}", flush=True)
    a.rounds_only = a.rounds_only or a.c16_only
    for r in range(a.rounds):
        row = {}
        if r % 2 == 0:  # in-process first in even rounds, last in odd ones: drift hits both alike
            row["in_process_b16"] = in_process()["tokens_per_s"]
        with Server(["--max-batch-size", "16"]) as s:
            row["serve_c16"] = bench_serve(s.url, 16)["tokens_per_s"]
            if not a.c16_only:
                row["serve_c32"] = bench_serve(s.url, 32)["tokens_per_s"]
        if not a.c16_only:
            with Server(["--max-batch-size", "16", "--data-parallel-size", "2"]) as s:
                row["serve_dp2_c32"] = bench_serve(s.url, 32)["tokens_per_s"]
        if r % 2 == 1:
            row["in_process_b16"] = in_process()["tokens_per_s"]
        row["load"] = os.getloadavg()
        out["rounds"].append(row)
        print(f"round {r}: {json.dumps(row)}", flush=True)
    if a.rounds_only:
        summarize(out)
        if a.json:
            a.json.write_text(json.dumps(out, indent=1, default=str))
        return 0
    with Server(["--max-batch-size", "16"]) as s:
        out["poisson_200_from_50"] = bench_serve(s.url, 50, workload="poisson", requests=200, rate=20)
        out["serve_text_c16"] = bench_serve(s.url, 16, api="completions-text", requests=32)
        if a.guidellm:
            out["guidellm_serve_c16"] = guidellm(a.guidellm, s.url, 16)
    with Server(["--max-batch-size", "16", "--data-parallel-size", "2"]) as s:
        if a.guidellm:
            out["guidellm_serve_dp2_c32"] = guidellm(a.guidellm, s.url, 32)
    if a.accelerate and shutil.which("transformers", path=str(Path(PY).parent)):
        port = 8400 + os.getpid() % 500
        env = dict(ENV, PYTHONPATH=a.accelerate)
        cmd = [str(Path(PY).parent / "transformers"), "serve", "--continuous-batching", "--device", "cpu", "--port",
               str(port), "--cb-block-size", "16", str(ROOT / "cbteach" / "bierce")]
        with Server([], cmd=cmd, url=f"http://127.0.0.1:{port}", ready="/v1/models", env=env) as s:
            out["transformers_serve_text_c16"] = bench_serve(s.url, 16, api="completions-text", requests=32,
                                                             model=str(ROOT / "cbteach" / "bierce"))
    out["load_at_end"] = os.getloadavg()
    summarize(out)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


def summarize(out) -> None:
    rounds = out["rounds"]
    ip, c16 = median(rounds, "in_process_b16"), median(rounds, "serve_c16")
    t = {"server_vs_in_process_c16": c16 / ip,
         "server_vs_in_process_c16_rounds": [x["serve_c16"] / x["in_process_b16"] for x in rounds]}
    out["targets"] = t
    if "serve_c32" not in rounds[0]:
        print(f"\n{out['machine']['cpus']} processors; medians over {len(rounds)} rounds (output tokens/s)")
        print(f"  in-process engine, batch 16: {ip:.0f}; server at 16 clients: {c16:.0f} -> "
              f"{t['server_vs_in_process_c16']:.2f}x (rounds: "
              f"{', '.join(f'{x:.2f}' for x in t['server_vs_in_process_c16_rounds'])})")
        return
    c32, dp = median(rounds, "serve_c32"), median(rounds, "serve_dp2_c32")
    t["dp2_vs_one_core_c32"] = dp / c32
    po = out.get("poisson_200_from_50")
    if po is not None:
        t["poisson_failed"] = po["num_failed"]
    if "transformers_serve_text_c16" in out:
        t["cbteach_vs_transformers_serve_text_c16"] = (out["serve_text_c16"]["tokens_per_s"]
                                                       / out["transformers_serve_text_c16"]["tokens_per_s"])
    out["targets"] = t
    cpus = out["machine"]["cpus"]
    print(f"\n{cpus} processors; medians over {len(rounds)} rounds (output tokens/s)")
    print(f"  in-process engine, batch 16: {ip:.0f}; server at 16 clients: {c16:.0f} -> {t['server_vs_in_process_c16']:.2f}x"
          f" (target >= 0.8x: {'met' if t['server_vs_in_process_c16'] >= 0.8 else 'NOT met'})")
    print(f"  one core at 32 clients: {c32:.0f}; two cores: {dp:.0f} -> {t['dp2_vs_one_core_c32']:.2f}x (target >= 1.6x"
          f" on >= 4 processors: {'met' if t['dp2_vs_one_core_c32'] >= 1.6 else 'NOT met'}"
          f"{'' if cpus >= 4 else '; this machine has fewer'})")
    if po is not None:
        print(f"  Poisson, 200 requests from 50 clients: {po['num_completed']} done, "
              f"{po['num_failed']} failed; TTFT p50/p99 {1e3 * po['ttft_p50']:.0f}/{1e3 * po['ttft_p99']:.0f} ms, "
              f"ITL p50/p99 {1e3 * po['itl_p50']:.1f}/{1e3 * po['itl_p99']:.1f} ms")
    if "cbteach_vs_transformers_serve_text_c16" in t:
        print(f"  text prompts, 16 clients: cbteach serve {out['serve_text_c16']['tokens_per_s']:.0f}, transformers "
              f"serve {out['transformers_serve_text_c16']['tokens_per_s']:.0f} -> "
              f"{t['cbteach_vs_transformers_serve_text_c16']:.1f}x")
    for k in ("guidellm_serve_c16", "guidellm_serve_dp2_c32"):
        if k in out:
            g = out[k]
            print(f"  GuideLLM {k[9:]}: {g['output_tokens_per_s']:.0f} output tok/s, TTFT median "
                  f"{g['ttft_ms']['median']:.0f} ms, ITL median {g['itl_ms']['median']:.1f} ms")


if __name__ == "__main__":
    raise SystemExit(main())
