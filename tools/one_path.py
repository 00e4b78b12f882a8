"""What a learner reads when they follow the default engine's step: which cbteach files run inside
``Engine.step()``, how many lines they hold, and how many of those lines name a variant the default
engine does not use.

The default engine is ``Engine(model, tok, max_batch_size=4, kv="paged")`` on the embedded model.
Its step is traced (``sys.settrace``, here in a tool, never in the package) over a short workload
that takes the default path's branches: prefills, decodes, a request that finishes while others
run, a queued request admitted into the freed slot, and the last message after everyone finished.
Construction is not traced: only what runs inside ``step()`` counts.

A line "names a variant" when it names one of the features that live beside the core (V0's rules,
async scheduling, speculative decoding, forked samples, failed-step recovery, tensor parallelism,
the learner's plug-ins, int8 KV, disaggregation): :data:`VARIANT` is the pattern, printed with the
result so the count can be checked by eye.

    python tools/one_path.py            # the table
    python tools/one_path.py --json     # the same as JSON (the test reads it)
    python tools/one_path.py --map      # README's reading map, with today's line counts
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "cbteach"

# Words that name a variant (case-insensitive, matched anywhere in a line, comments and docstrings too:
# a learner reads those). Kept broad on purpose -- a word the core needs for itself ("async" in
# "asynchronous copy", say) is counted all the same; only torch's ``uint8`` dtype is not int8 KV.
VARIANT = re.compile(
    r"swap|watermark|\bfork|copy.on.write|\bcow\b|async|placeholder|speculat|\bdraft|guess|proposer|"
    r"recover|unwritten|tensor.parallel|\btp\b|\brank|plug|learner|exercise|\bv0\b|(?<!u)int8|quantiz|"
    r"disaggregat|handover|before_free|whole_prompt|preempt_to_admit|parallel_sampling|fanout",
    re.IGNORECASE,
)


# The one path in the order a learner reads it, and the V1 files each part follows. README's reading map
# is this table (``--map``); tests/test_one_path.py checks that it lists exactly the traced files.
READ_ORDER = [
    ("1 the messages", ["core/scheduler_output.py"], "`v1/core/sched/output.py`, `v1/outputs.py`"),
    ("2 a request", ["core/request.py", "core/sampling.py"], "`v1/request.py`, `vllm/sampling_params.py`"),
    ("3 the scheduler", ["engine/scheduler.py", "engine/policies.py"],
     "`v1/core/sched/scheduler.py`, `request_queue.py`"),
    ("4 the KV manager", ["kv/manager.py", "kv/paged.py"],
     "`v1/core/kv_cache_manager.py`, `block_pool.py`"),
    ("5 the engine core", ["engine/engine_core.py", "executor/uniproc.py"],
     "`v1/engine/core.py`, `v1/executor/` (ours: the model-changed check)"),
    ("6 the worker", ["worker/input_batch.py", "worker/model_runner.py"],
     "`v1/worker/gpu_input_batch.py`, `block_table.py`, `gpu_model_runner.py`, `v1/sample/`"),
    ("7 attention", ["attention/metadata.py", "attention/paged.py"], "`v1/attention/backends/`"),
    ("(bookkeeping)", ["core/records.py"], "none: ours (step records; what they say is built when read)"),
]


def map_table() -> str:
    """README's reading map: each part of the one path, its files with their line counts, V1's files."""
    rows = ["| read | files (lines) | V1 |", "|---|---|---|"]
    for what, files, v1 in READ_ORDER:
        cells = ", ".join(f"`{f}` ({len((PACKAGE / f).read_text().splitlines())})" for f in files)
        rows.append(f"| {what} | {cells} | {v1} |")
    return "\n".join(rows)


def traced_files(steps_after: int = 0) -> set[Path]:
    """The package's files whose code runs inside ``Engine.step()`` on the default engine."""
    from cbteach import Engine, Request, load_model

    model, tok = load_model()
    prompts = ["The engine", "A request that waits for a slot", "Short", "Ink", "Of all the words",
               "The last one"]
    lengths = [6, 3, 9, 4, 5, 2]
    files: set[Path] = set()

    def tracer(frame, event, arg):
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(PACKAGE):
            files.add(path)
        return None  # 'call' events are enough: a file counts once any of its code runs

    with Engine(model, tok, max_batch_size=4, kv="paged") as eng:
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            eng.add_request(Request(p, max_new_tokens=n, request_id=f"r{i}"))
        threading.settrace(tracer)
        sys.settrace(tracer)
        try:
            while eng.has_requests():
                eng.step()
        finally:
            sys.settrace(None)
            threading.settrace(None)
    return files


def measure() -> dict:
    """Files, lines and variant lines of the default step, file by file."""
    rows = []
    for path in sorted(traced_files()):
        lines = path.read_text().splitlines()
        variant = [i + 1 for i, line in enumerate(lines) if VARIANT.search(line)]
        rows.append({"file": str(path.relative_to(ROOT)), "lines": len(lines), "variant_lines": len(variant),
                     "variant_at": variant})
    return {"files": len(rows), "lines": sum(r["lines"] for r in rows),
            "variant_lines": sum(r["variant_lines"] for r in rows), "pattern": VARIANT.pattern, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print JSON")
    ap.add_argument("--map", action="store_true", help="print README's reading map")
    args = ap.parse_args(argv)
    if args.map:
        print(map_table())
        return 0
    result = measure()
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{'file':44s} {'lines':>6s} {'variant':>8s}")
    for r in result["rows"]:
        print(f"{r['file']:44s} {r['lines']:6d} {r['variant_lines']:8d}")
    print(f"{'total: ' + str(result['files']) + ' files':44s} {result['lines']:6d} {result['variant_lines']:8d}")
    print(f"\nvariant pattern: {result['pattern']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
