#!/usr/bin/env python
"""One script for the checks that need an accelerator: ``make gpu-check`` (``--small`` runs on a CPU in seconds).

1. **notebooks** -- every ``notebooks/*.ipynb`` executed with nbclient on whatever device the course
   picks (cuda, then mps, then cpu): cells that raised, and seconds, per notebook. Skipped (and
   said so) when nbclient is not installed or with ``--skip-notebooks``.
2. **exact_fp32** -- on the device, in fp32, each batching mode (static, concat, paged, paged with a
   token budget of 32, paged under async scheduling -- on CUDA its host copies on a side stream) against
   per-prompt greedy ``model.generate`` on bierce headwords: ``[equal, total]`` requests.
3. **throughput** -- tokens/s of ``static``, ``cbteach_concat``, ``cbteach_paged`` and
   ``transformers_cb`` (see ``cbteach/bench/measure.py``) on two workloads: ``bierce`` (headwords, batch 32)
   and ``llama_1b`` (a random-weight Llama of TinyLlama-1.1B's shape, built from its config -- no
   download -- in bf16: 128 requests, prompts of 16-512 random tokens, skewed output lengths,
   ``ignore_eos``, batch 32). For each cbteach engine the first (untimed) and the timed run's
   seconds go to ``first_run_seconds``: a large gap is a per-shape warm-up tax.
4. **kernel** -- on CUDA with Triton only: the paged-attention kernel (``attention="triton"``) against
   the gather attention and PyTorch's SDPA on a padded batch, one layer's decode step at batch 16 and 64
   for bierce's and TinyLlama-1.1B's attention shapes (:mod:`cbteach.bench.kernel_bench`), printed as
   claims; and ``exact_fp32`` gains a ``paged_triton`` mode (the engine on the kernel vs ``generate``).

Every part is guarded: a failure is recorded under ``errors`` and the rest still runs. The JSON
(``--out``, default ``benchmarks/results/gpu.json``) is rewritten after each part, so a run cut
short still leaves what it measured.

Without a GPU (CUDA, or Apple's MPS) the full run refuses at once with exit status 2 -- its sizes
would take far over ten minutes on a CPU -- and says to use ``--small``, the CPU version. Ctrl-C
(SIGINT) and SIGTERM stop the whole run, not just the notebook that is running: the notebook's
kernel is shut down, what was measured so far is saved, and the exit status is 130 / 143.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a checkout, installed or not

import torch  # noqa: E402

from cbteach import Engine, Request, load_model, static_batching  # noqa: E402
from cbteach.bench.measure import ENGINES, clean, compare, headword_requests, random_llama  # noqa: E402
from cbteach.bierce.corpus import headword_prompts  # noqa: E402
from cbteach.models import pick_device  # noqa: E402

FULL = {"exact_n": 32, "exact_new": 256, "exact_batch": 8, "bierce_n": 128, "bierce_new": 256, "batch": 32,
        "llama": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                      intermediate_size=5632), "llama_n": 128, "prompt": (16, 512), "out_median": 48, "out_cap": 384}
SMALL = {"exact_n": 4, "exact_new": 24, "exact_batch": 3, "bierce_n": 8, "bierce_new": 24, "batch": 4,
         "llama": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=704), "llama_n": 8, "prompt": (16, 48), "out_median": 8, "out_cap": 24}
T0 = time.perf_counter()


class Stopped(BaseException):
    """Raised by SIGINT/SIGTERM. A BaseException, so no ``except Exception`` -- a guarded part, a
    notebook's error handling -- swallows it and goes on to the next part."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum, frame):
    raise Stopped(signum)


def log(msg: str) -> None:
    print(f"[gpu_check {time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def guarded(result: dict, part: str, fn):
    """Run one part; on failure record the traceback's last line under ``errors`` and go on."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001
        log(f"{part} FAILED: {type(err).__name__}: {err}")
        result.setdefault("errors", {})[part] = traceback.format_exc(limit=3)[-2000:]
        return None


def execute_notebook(path: Path, timeout: int) -> dict:
    """Run one notebook with nbclient (cells that raise are recorded, not fatal); what run_notebooks
    reads back. Runs in a child process: see run_notebooks."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    entry = {}
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    except Exception as err:  # noqa: BLE001  (dead kernel, timeout: count it as an error and go on)
        entry["exception"] = f"{type(err).__name__}: {str(err)[:500]}"
    errs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.get("output_type") == "error"]
    entry["errors"] = len(errs) + ("exception" in entry)
    if errs:
        entry["first_error"] = f"{errs[0].get('ename')}: {errs[0].get('evalue', '')[:300]}"
    return entry


def run_notebooks(paths, timeout=900) -> dict:
    """Every notebook, each in a child process of its own (``--run-notebook``). nbclient takes over
    SIGINT/SIGTERM while it runs a notebook (to shut its kernel down) and then resets them, so in
    this process a signal would be lost; here our handlers stay in place, and on a signal the child
    is told to stop (it shuts its kernel down) and then killed if it lingers."""
    out = {}
    for path in paths:
        log(f"notebook {path.name} ...")
        t0 = time.perf_counter()
        result = ROOT / "benchmarks" / "results" / f".notebook-{os.getpid()}.json"
        result.parent.mkdir(parents=True, exist_ok=True)
        child = subprocess.Popen([sys.executable, __file__, "--run-notebook", str(path), "--out", str(result),
                                  "--timeout", str(timeout)], start_new_session=True)
        try:
            child.wait()
        except Stopped:
            _end(child)
            raise
        try:
            entry = json.loads(result.read_text())
            result.unlink()
        except (OSError, ValueError):
            entry = {"errors": 1, "exception": f"the notebook's process ended with exit status {child.returncode}"}
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        out[path.name] = entry
        log(f"  {path.name}: {entry['errors']} error(s), {entry['seconds']} s")
    return out


def _end(child: subprocess.Popen) -> None:
    """Stop a notebook's process: SIGTERM (nbclient then shuts its kernel down), SIGKILL after 20 s."""
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(child.pid, sig)
            child.wait(timeout=wait)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            if child.poll() is not None:
                return


def reference(model, prompt_ids, max_new_tokens, eos):
    """Greedy per-prompt ``generate``: the ground truth."""
    ids = torch.tensor([prompt_ids], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=eos, pad_token_id=eos)
    return out[0, ids.shape[1]:].tolist()


def exact_fp32(device, n, max_new, batch) -> dict:
    model, tok = load_model("bierce", device=device, dtype=torch.float32)
    prompts = headword_prompts(n)
    eos = model.generation_config.eos_token_id
    want = [reference(model, tok(p)["input_ids"], max_new, eos) for p in prompts]
    reqs = lambda: [Request(p, max_new) for p in prompts]  # noqa: E731
    modes = {"static": lambda: static_batching(model, tok, reqs(), batch),
             "concat": lambda: Engine(model, tok, max_batch_size=batch, kv="concat").run(reqs()),
             "paged": lambda: Engine(model, tok, max_batch_size=batch, kv="paged").run(reqs()),
             "paged_budget32": lambda: Engine(model, tok, max_batch_size=batch, kv="paged", token_budget=32).run(reqs()),
             "paged_async": lambda: Engine(model, tok, max_batch_size=batch, kv="paged", async_scheduling=True).run(reqs())}
    if _has_kernel(device):
        modes["paged_triton"] = lambda: Engine(model, tok, max_batch_size=batch, kv="paged", attention="triton",
                                               token_budget=32).run(reqs())
    out = {}
    for mode, fn in modes.items():
        got = [c.output_ids for c in fn()]
        out[mode] = [sum(g == w for g, w in zip(got, want)), len(want)]
        log(f"  exact_fp32 {mode}: {out[mode][0]}/{out[mode][1]} equal to model.generate")
    return out


def _has_kernel(device) -> bool:
    """The Triton kernel can be measured: a CUDA device and Triton installed."""
    from cbteach.attention.triton_mode import available

    return torch.device(device).type == "cuda" and available()


def llama_requests(n, prompt_range, out_median, out_cap, vocab=32000, seed=0):
    """Prompts of random tokens, output lengths log-normal (most short, a few long), ignore_eos."""
    rng = random.Random(seed)
    spec = [([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))],
             max(4, min(out_cap, int(rng.lognormvariate(math.log(out_median), 1.0))))) for _ in range(n)]
    return lambda: [Request(p, m, ignore_eos=True) for p, m in spec]


def throughput(name, model, tok, make_requests, batch, result, full_warmup=ENGINES) -> dict:
    log(f"throughput {name}: {len(make_requests())} requests, batch {batch}")
    rows = compare(model, tok, make_requests, batch, full_warmup=full_warmup)
    for engine, r in rows.items():
        if "error" in r:
            log(f"  {engine:16s} FAILED: {r['error']}")
            result.setdefault("errors", {})[f"{name}/{engine}"] = r["error"]
        else:
            log(f"  {engine:16s} {r['tokens_per_s']:9.0f} tok/s  {r['seconds']:7.2f} s (first run "
                f"{r['first_run_seconds']:.2f} s)  same as static: {r.get('identical_to_static', '-')}")
    result.setdefault("details", {})[name] = rows
    result.setdefault("first_run_seconds", {})[name] = {
        e: [rows[e].get("first_run_seconds"), rows[e].get("seconds")] for e in ENGINES if e in full_warmup}
    return {e: rows.get(e, {}).get("tokens_per_s") for e in ENGINES}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="tiny sizes: runs on a CPU in well under a minute")
    p.add_argument("--skip-notebooks", action="store_true")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu.json")
    p.add_argument("--run-notebook", type=Path, help=argparse.SUPPRESS)  # internal: one notebook, see run_notebooks
    p.add_argument("--timeout", type=int, default=900, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.run_notebook:
        a.out.write_text(json.dumps(execute_notebook(a.run_notebook, a.timeout)))
        return 0
    sizes = SMALL if a.small else FULL
    device = pick_device()
    if not a.small and device.type == "cpu":
        print(f"gpu_check: no GPU here (torch {torch.__version__} sees no CUDA or MPS device); the full check "
              "would run for well over ten minutes on a CPU. Run it on a GPU machine, or run the CPU "
              "version: python tools/gpu_check.py --small", file=sys.stderr)
        return 2
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _stop)
    try:
        return run_all(a, sizes, device)
    except Stopped as stop:
        log(f"stopped by {stop}; what was measured so far is in {a.out}")
        return 128 + stop.signum


def run_all(a, sizes, device) -> int:
    if device.type == "cpu":
        torch.set_num_threads(1)  # small models gain nothing from more, and a shared CPU stays predictable
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    result = {"device": name, "notebooks": {}, "exact_fp32": {}, "throughput": {"bierce": {}, "llama_1b": {}},
              "small": a.small, "torch": torch.__version__}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    save = lambda: a.out.write_text(json.dumps(clean(result), indent=1))  # noqa: E731
    log(f"device {name}; {'small' if a.small else 'full'} sizes; results -> {a.out}")

    if a.skip_notebooks:
        result["notebooks_skipped"] = "--skip-notebooks"
    else:
        try:
            import nbclient  # noqa: F401
        except ImportError:
            result["notebooks_skipped"] = "nbclient is not importable"
            log("notebooks skipped: nbclient is not importable")
        else:
            result["notebooks"] = guarded(result, "notebooks",
                                          lambda: run_notebooks(sorted((ROOT / "notebooks").glob("*.ipynb")))) or {}
    save()

    log(f"exact_fp32: {sizes['exact_n']} headwords, max_new_tokens {sizes['exact_new']}, batch {sizes['exact_batch']}")
    result["exact_fp32"] = guarded(result, "exact_fp32", lambda: exact_fp32(
        device, sizes["exact_n"], sizes["exact_new"], sizes["exact_batch"])) or {}
    save()

    def bierce():
        model, tok = load_model("bierce", device=device)
        return throughput("bierce", model, tok, headword_requests(sizes["bierce_n"], sizes["bierce_new"]),
                          sizes["batch"], result)
    result["throughput"]["bierce"] = guarded(result, "throughput/bierce", bierce) or {}
    save()

    def llama():
        model = random_llama(device, torch.bfloat16, **sizes["llama"])  # TinyLlama-1.1B-shaped, bf16
        reqs = llama_requests(sizes["llama_n"], sizes["prompt"], sizes["out_median"], sizes["out_cap"])
        lens = [r.max_new_tokens for r in reqs()]
        log(f"llama_1b: {sum(q.numel() for q in model.parameters()) / 1e9:.2f} B params, outputs "
            f"{min(lens)}-{max(lens)} tokens (mean {sum(lens) / len(lens):.0f})")
        # Static and transformers warm up on one short wave: their full first run would only add minutes.
        return throughput("llama_1b", model, None, reqs, sizes["batch"], result,
                          full_warmup=("cbteach_concat", "cbteach_paged"))
    result["throughput"]["llama_1b"] = guarded(result, "throughput/llama_1b", llama) or {}
    save()

    if _has_kernel(device):
        from cbteach.bench import kernel_bench
        log("kernel: Triton paged attention vs the gather vs SDPA on a padded batch (one layer, decode)")
        result["kernel"] = guarded(result, "kernel", kernel_bench.run) or {}
    else:
        result["kernel_skipped"] = "needs a CUDA device and Triton (pip install \"cbteach[kernels]\")"
        log(f"kernel skipped: {result['kernel_skipped']}")
    result["seconds"] = round(time.perf_counter() - T0, 1)
    save()
    log(f"done in {result['seconds']} s; wrote {a.out}")
    return 1 if result.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
