"""``python -m cbteach bench-serve --endpoint URL``: the benchmark, pointed at any OpenAI-compatible server.

The in-process benchmark (:mod:`.measure`) times engines from inside; a server has to be timed from
outside, as its users see it -- which is what vLLM's ``benchmarks/benchmark_serving.py`` does, and
what this client does the same way: the same seeded workloads as ``python -m cbteach bench``
(:mod:`cbteach.serving.workloads`), sent over HTTP as streamed requests, at most ``--concurrency`` at
once and (``poisson``) at their arrival times; each request's send time, first token and every later
chunk recorded on the client's clock; and the same metric names (:func:`cbteach.serving.metrics.summarize`:
TTFT, TPOT, ITL, E2E, output tokens/s, requests/s, goodput).

Any server will do: ``python -m cbteach serve``, ``transformers serve``, ``vllm serve``. Prompts are
token ids on ``/v1/completions`` (``--api completions``, exact: no re-tokenizing) or the same ids
decoded to text (``--api completions-text``, for servers that take only text prompts, such as
``transformers serve``; the server tokenizes them again) or sent as one user message to
``/v1/chat/completions`` (``--api chat``).
Workloads that ignore EOS send vLLM's ``ignore_eos``; a server that does not know it may stop early, so
output tokens are counted from what came back (the ``usage`` of the last chunk, else the chunks).

As in vLLM's benchmark, a chunk is a token for ITL: a server that sends several tokens in one chunk
(speculative decoding) shows one gap for them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import urllib.parse
from pathlib import Path

from ..serving import workloads as wl
from ..serving.metrics import summarize

METRICS = ("ttft", "tpot", "itl", "e2e")


class Answer:
    """What one streamed request gave, shaped like a :class:`cbteach.Completion` for ``summarize``."""

    def __init__(self, request_id, prompt_ids, arrival_time):
        self.request_id, self.prompt_ids, self.arrival_time = request_id, list(prompt_ids), arrival_time
        self.output_ids: list = []
        self.token_times: list[float] = []
        self.first_token_time = self.finish_time = None
        self.finish_reason = "aborted"  # until the stream ends properly
        self.text = ""
        self.pieces: list[str] = []
        self.error = None


async def _one(client, url, i, prompt, max_tokens, args, workload, tok, t0) -> Answer:
    ans = Answer(f"r{i}", prompt, time.perf_counter() - t0)
    body = {"model": args.model, "max_tokens": int(max_tokens), "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if workload.ignore_eos:
        body["ignore_eos"] = True
    if args.api == "chat":
        body["messages"] = [{"role": "user", "content": tok.decode(prompt)}]
    else:
        body["prompt"] = tok.decode(prompt) if args.api == "completions-text" else list(prompt)
    usage, chunks = None, 0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                ans.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return ans
            async for event, now in _events(r, t0):
                if event.get("error"):  # the server cut the stream short (vLLM's and cbteach's error event)
                    ans.error = f"stream error: {event['error'].get('message', event['error'])}"[:200]
                    return ans
                usage = event.get("usage") or usage
                for c in event.get("choices") or []:
                    piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    if piece or c.get("token_ids"):
                        chunks += 1
                        ans.token_times.append(now)
                        ans.output_ids.extend(c.get("token_ids") or [])
                        ans.pieces.append(piece or "")
                    if c.get("finish_reason"):
                        ans.finish_reason = c["finish_reason"]
        ans.finish_time = time.perf_counter() - t0
        ans.text = "".join(ans.pieces)
    except Exception as err:  # a server that hangs up or times out: counted, reported, never fatal
        ans.error = f"{type(err).__name__}: {err}"
        return ans
    n = (usage or {}).get("completion_tokens") or len(ans.output_ids) or chunks
    if len(ans.output_ids) != n:
        ans.output_ids = [None] * n  # the count is what the metrics need
    ans.first_token_time = ans.token_times[0] if ans.token_times else None
    return ans


async def _events(response, t0: float):
    """``(event, seconds since t0)`` for each server-sent ``data:`` JSON event of a streamed response, as its
    bytes arrive: split on blank lines, decoded with msgspec (a client that costs little CPU measures the
    server, not itself -- on a small machine they share the processors)."""
    import msgspec

    decode, buf = msgspec.json.decode, b""
    async for part in response.aiter_bytes():
        buf = (buf + part).replace(b"\r\n", b"\n")  # (a CRLF split over two parts is joined first)
        *done, buf = buf.split(b"\n\n")
        if not done:
            continue
        now = time.perf_counter() - t0
        for block in done:
            for line in block.split(b"\n"):
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    yield decode(line[6:]), now


async def run(base_url: str, workload, args, tok) -> tuple[list[Answer], float]:
    """Send ``workload`` to the server; returns the answers (workload order) and the wall time."""
    import httpx

    path = "/chat/completions" if args.api == "chat" else "/completions"
    url = base_url.rstrip("/") + ("" if base_url.rstrip("/").endswith("/v1") else "/v1") + path
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    gate = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    from tqdm.auto import tqdm

    bar = tqdm(total=len(workload.prompts), desc=f"bench-serve, {args.concurrency} clients", unit="req",
               disable=not getattr(args, "progress", False), leave=False)  # (the client's own work: tiny)
    async with httpx.AsyncClient(timeout=args.timeout, headers=headers, limits=limits) as client:
        t0 = time.perf_counter()

        async def send(i, prompt, m):
            if workload.arrival_times is not None:
                await asyncio.sleep(max(0.0, workload.arrival_times[i] - (time.perf_counter() - t0)))
            async with gate:
                answer = await _one(client, url, i, prompt, m, args, workload, tok, t0)
            bar.update()
            return answer

        try:
            answers = await asyncio.gather(*(send(i, p, m) for i, (p, m) in
                                             enumerate(zip(workload.prompts, workload.max_new_tokens))))
        finally:
            bar.close()
        return list(answers), time.perf_counter() - t0


def measure(base_url: str, workload, args, tok) -> dict:
    """One run: ``summarize``'s numbers plus failures, the concurrency and the wall time."""
    answers, wall = asyncio.run(run(base_url, workload, args, tok))
    failed = [a for a in answers if a.error is not None or a.first_token_time is None]
    ok = [a for a in answers if a not in failed]
    row = summarize(ok, ttft_target=args.ttft_target, tpot_target=args.tpot_target) if ok else {}
    row.update({"concurrency": args.concurrency, "wall_s": wall, "num_failed": len(failed),
                "errors": sorted({a.error for a in failed if a.error})[:3]})
    return row


def parser() -> argparse.ArgumentParser:
    from ..argtypes import POSITIVE, POSITIVE_INT, number
    from ..serving.server_cli import DefaultsOnce

    p = argparse.ArgumentParser(prog="python -m cbteach bench-serve", formatter_class=DefaultsOnce,
                                description="Benchmark any OpenAI-compatible server (cbteach serve, transformers "
                                            "serve, vllm serve) with the workloads and metrics of 'cbteach bench'.")
    p.add_argument("--endpoint", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000 (or .../v1)")
    p.add_argument("--model", default="bierce", help="the model name sent in each request")
    p.add_argument("--tokenizer", default="bierce", help="tokenizer that builds the workload's token-id prompts")
    p.add_argument("--api", choices=("completions", "completions-text", "chat"), default="completions",
                   help="completions: prompts as token ids; completions-text: the same prompts decoded to text (for "
                        "servers that take only text, e.g. transformers serve); chat: as one user message")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer' (default: $OPENAI_API_KEY, else none)")
    p.add_argument("--workload", default="headwords", choices=wl.WORKLOADS)
    p.add_argument("--requests", type=POSITIVE_INT, default=32, help="number of requests")
    p.add_argument("--max-new-tokens", type=POSITIVE_INT, default=128, help="output cap of headwords and poisson")
    p.add_argument("--cap", type=POSITIVE_INT, default=64, help="length_variance: the cap on exponential output lengths")
    p.add_argument("--rate", type=POSITIVE, default=8.0, help="poisson: requests per second")
    p.add_argument("--seed", type=number(int, 0, strict=False), default=0, help="the workload's random seed")
    p.add_argument("--concurrency", default="16", help="most requests in flight; a list (1,16) runs once per value")
    p.add_argument("--warmup", type=number(int, 0, strict=False), default=4,
                   help="requests sent (untimed) before the timed runs")
    p.add_argument("--timeout", type=POSITIVE, default=300.0, help="seconds one request may take")
    p.add_argument("--ttft-target", type=POSITIVE, default=1.0, help="goodput: TTFT target in seconds")
    p.add_argument("--tpot-target", type=POSITIVE, default=0.05, help="goodput: TPOT target in seconds")
    p.add_argument("--json", type=Path, default=None, help="write the results (and the workload) here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _ms(row, key) -> str:
    v = row.get(key)
    return "-" if v is None else f"{1e3 * v:.1f}"


def print_rows(rows: list) -> None:
    print(f"  {'concurrency':>11s} {'tok/s':>7s} {'req/s':>6s} " + " ".join(f"{m.upper() + ' p50/p99':>15s}"
                                                                    for m in METRICS) + "  failed")
    for r in rows:
        lat = " ".join(f"{_ms(r, m + '_p50') + '/' + _ms(r, m + '_p99'):>15s}" for m in METRICS)
        tps, rps = r.get("tokens_per_s"), r.get("requests_per_s")
        print(f"  {r['concurrency']:>11d} {tps or 0:7.0f} {rps or 0:6.2f} {lat}  {r['num_failed']}"
              + (f"  {r['errors']}" if r["errors"] else ""))
    print("  (latencies in ms, on the client's clock)")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = parser().parse_args(argv)
    from ..serving.server_cli import given

    ignored = wl.unread(a.workload, given(parser, argv, wl.READ_BY))
    try:
        levels = [int(x) for x in a.concurrency.split(",")]
    except ValueError:
        levels = []
    url = urllib.parse.urlsplit(a.endpoint)
    wrong = [(not levels or min(levels) < 1, f"--concurrency takes integers >= 1 (e.g. 1,16), got {a.concurrency!r}"),
             (url.scheme not in ("http", "https") or not url.hostname,
              f"--endpoint takes the server's http(s) URL, e.g. http://127.0.0.1:8000, got {a.endpoint!r}"),
             (bool(ignored), wl.unread_error(a.workload, ignored))]
    said = next((why for bad, why in wrong if bad), None)
    if said is not None:
        print(f"python -m cbteach bench-serve: error: {said}", file=sys.stderr)
        return 2
    from ..argtypes import unwritable

    problem = a.json is not None and unwritable(a.json)
    if problem:  # found now, not after the whole benchmark has run
        print(f"python -m cbteach bench-serve: error: --json {a.json}: {problem}", file=sys.stderr)
        return 2
    try:
        import httpx  # noqa: F401
        from transformers import AutoTokenizer

        from ..models import load_model
        try:
            tok = load_model("bierce")[1] if a.tokenizer == "bierce" else AutoTokenizer.from_pretrained(a.tokenizer)
        except OSError as err:
            raise ValueError(f"cannot load the tokenizer {a.tokenizer!r} (offline? the embedded one is "
                             f"--tokenizer bierce): {str(err).splitlines()[0]}") from None
        workload = wl.build(a.workload, tok, a.requests, max_new_tokens=a.max_new_tokens, cap=a.cap, rate=a.rate,
                            seed=a.seed)
    except ImportError as err:
        print(f"bench-serve needs httpx and transformers ({err}): pip install 'cbteach[serve]' httpx", file=sys.stderr)
        return 1
    except (ValueError, OSError) as err:
        print(f"cannot build the workload: {err}", file=sys.stderr)
        return 2
    print(f"{workload.description}; endpoint {a.endpoint} ({a.api})")
    a.progress = not a.no_progress
    rows = []
    for level in levels:
        a.concurrency = level
        if a.warmup:
            asyncio.run(run(a.endpoint, workload.head(min(a.warmup, len(workload))), a, tok))
        rows.append(measure(a.endpoint, workload, a, tok))
    print_rows(rows)
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"endpoint": a.endpoint, "api": a.api, "workload": workload.summary(),
                                      "rows": rows}, indent=1, default=str))
    return 0 if all(r["num_failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
