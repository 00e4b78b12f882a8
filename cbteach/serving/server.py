"""``python -m cbteach serve``: the engine behind an OpenAI-compatible HTTP API (notebook 11).

Continuous batching is a serving technique: its point is that a chat message arriving while others
are being answered joins the running batch at the next step instead of waiting for the batch to
drain. This module puts the course's engine where that happens: one :class:`~cbteach.Engine`,
stepped by one background thread (:mod:`.server_worker`), behind FastAPI routes
(:mod:`.server_app`) that speak OpenAI's protocol (:mod:`.openai_protocol`) -- so the same client
code and benchmark talk to this server, to ``transformers serve`` and to ``vllm serve``.

Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (streamed or not), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus, vLLM's names; :mod:`.server_metrics`), and ``GET /``,
the live view of the batch (:mod:`.server_live`).

Safe by default: it binds to 127.0.0.1; ``--api-key`` (or ``CBTEACH_API_KEY``) makes every ``/v1``
route require ``Authorization: Bearer <key>`` (``/health``, ``/metrics`` and the live view answer
without it, as vLLM's do), and a non-loopback ``--host`` refuses to start without a key. Requests are
capped (``--max-tokens-cap``, ``--max-n``, ``--max-body-bytes``, ``--max-in-flight``). SIGTERM stops
taking connections, lets in-flight requests finish for up to ``--drain-timeout`` seconds, aborts the
rest (their blocks freed) and exits 0.
"""
from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import signal
import sys
import threading
import time

SERVE_EXTRA = "cbteach serve needs FastAPI and uvicorn: pip install 'cbteach[serve]'"
LOOPBACK_NAMES = ("localhost",)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cbteach serve", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description="Serve a model with cbteach's continuous-batching engine behind an "
                                            "OpenAI-compatible API, with a live view of the batch at /.")
    p.add_argument("--model", default="bierce", help="bierce (embedded, offline), bierce-draft, or a hub id / folder")
    p.add_argument("--served-model-name", default=None, help="the name clients use in 'model' (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind; anything but loopback needs --api-key")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    p.add_argument("--api-key", default=os.environ.get("CBTEACH_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $CBTEACH_API_KEY, else none)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, mps, or auto (the best this machine has)")
    p.add_argument("--threads", type=_positive_int, default=1, help="torch CPU threads for the engine")
    e = p.add_argument_group("engine (the same options as cbteach.Engine)")
    e.add_argument("--kv", choices=("paged", "concat"), default="paged", help="KV cache")
    e.add_argument("--max-batch-size", type=_positive_int, default=8, help="most requests in one step (batch slots)")
    e.add_argument("--token-budget", type=_positive_int, default=None,
                   help="most tokens in one step; longer prompts are prefilled in chunks (default: no limit)")
    e.add_argument("--num-blocks", type=_positive_int, default=None,
                   help="paged: KV blocks in the pool (default: enough for every slot at the model's full length)")
    e.add_argument("--kv-memory-bytes", type=_positive_int, default=None, help="paged: size the pool by bytes instead")
    e.add_argument("--block-size", type=_positive_int, default=16, help="paged: tokens per KV block")
    e.add_argument("--policy", choices=("fcfs", "priority"), default="fcfs", help="waiting-queue order")
    e.add_argument("--preemption", choices=("recompute", "swap"), default="recompute",
                   help="how a request gives its KV blocks back when the pool is full")
    e.add_argument("--prefix-caching", action="store_true", help="paged: reuse cached blocks of shared prefixes")
    e.add_argument("--speculative", default=None,
                   help="speculative decoding: 'ngram' (prompt lookup) or a draft model's name (e.g. bierce-draft)")
    e.add_argument("--num-speculative-tokens", type=_positive_int, default=3, help="guesses per step")
    c = p.add_argument_group("per-request caps")
    c.add_argument("--max-tokens-cap", type=_positive_int, default=None,
                   help="the largest max_tokens a request may ask (default: the model's positions)")
    c.add_argument("--default-max-tokens", type=_positive_int, default=None,
                   help="max_tokens of a request that gives none (default: none, the field is required)")
    c.add_argument("--max-n", type=_positive_int, default=8, help="most choices (n x prompts) in one request")
    c.add_argument("--max-body-bytes", type=_positive_int, default=1 << 20, help="largest request body")
    c.add_argument("--max-in-flight", type=_positive_int, default=512,
                   help="requests queued or running at once; more get 503")
    p.add_argument("--drain-timeout", type=_positive_float, default=5.0,
                   help="on SIGTERM, seconds in-flight requests may take to finish before they are aborted")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    return p


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build(args):
    """``(app, hub, worker)`` for parsed arguments: the model loaded, the engine made, the worker not yet started."""
    from ..engine.engine import Engine
    from ..models import load_model
    from . import openai_protocol as proto
    from .server_app import create_app
    from .server_live import LiveHub
    from .server_metrics import ServerMetrics
    from .server_worker import EngineWorker

    import torch

    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, device=None if args.device == "auto" else args.device)
    options = {"token_budget": args.token_budget, "policy": args.policy, "preemption": args.preemption}
    if args.speculative:
        options["speculative"] = args.speculative if args.speculative == "ngram" else \
            load_model(args.speculative, device=model.device)[0]
        options["num_speculative_tokens"] = args.num_speculative_tokens
    if args.kv == "paged":
        options.update(block_size=args.block_size, prefix_caching=args.prefix_caching)
        for name in ("num_blocks", "kv_memory_bytes"):
            if getattr(args, name) is not None:
                options[name] = getattr(args, name)
    engine = Engine(model, tok, max_batch_size=args.max_batch_size, kv=args.kv, keep_records=False, **options)
    positions = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", 4096)
    gen = model.generation_config
    name = args.served_model_name or args.model
    limits = proto.Limits(served_model=name, max_tokens_cap=args.max_tokens_cap or positions, max_n=args.max_n,
                          default_max_tokens=args.default_max_tokens,
                          default_temperature=float(gen.temperature or 1.0) if gen.do_sample else 0.0)
    metrics, hub = ServerMetrics(name), LiveHub(args.max_batch_size)
    worker = EngineWorker(engine, metrics=metrics, observers=[hub.observe])
    app = create_app(worker, limits, hub, metrics, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                     max_in_flight=args.max_in_flight, max_model_len=positions)
    return app, hub, worker


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, taught a clean exit: on the first SIGTERM (or Ctrl-C) the live view's endless
        streams end at once, in-flight requests get ``drain_timeout`` seconds to finish, and then the rest are
        aborted -- their streams end with ``finish_reason: "abort"`` and ``[DONE]``, their blocks are freed --
        before uvicorn's own graceful timeout (a little later) would cut connections mid-stream."""

        hub = worker = None
        drain_timeout = 5.0
        _draining = False

        def handle_exit(self, sig, frame):
            if not self._draining and self.worker is not None:
                self._draining = True
                if self.hub.loop is not None:
                    self.hub.loop.call_soon_threadsafe(self.hub.close)
                timer = threading.Timer(self.drain_timeout, self.worker.abort_all)
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            """SIGINT and SIGTERM start the clean exit above, and the process then exits 0 (uvicorn's own version
            re-raises the signal after shutdown, which ends the process with -15 however cleanly it stopped)."""
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in old.items():
                    signal.signal(s, handler)

    return Server


def make_server(args):
    """A uvicorn server for parsed arguments (not running yet)."""
    import uvicorn

    app, hub, worker = build(args)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.drain_timeout + 5, access_log=args.log_level in ("info", "debug"))
    server = _server_class()(config)
    server.hub, server.worker, server.drain_timeout = hub, worker, args.drain_timeout
    return server


class ServerThread:
    """The server in a background thread of this process (tests, and a notebook that wants no subprocess).

    ``ServerThread(["--port", "0", ...]).start()`` returns once it answers; ``.url`` is its address;
    ``.stop()`` shuts it down as SIGTERM would (bounded)."""

    def __init__(self, argv=()):
        self.args = parser().parse_args(list(argv))
        self.server = make_server(self.args)
        self.thread = threading.Thread(target=self.server.run, name="cbteach-serve", daemon=True)

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        return self

    @property
    def url(self) -> str:
        sock = self.server.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        return f"http://{host}:{port}"

    def stop(self, timeout: float = 30.0) -> None:
        self.server.handle_exit(None, None)
        self.thread.join(timeout)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def main(argv=None) -> int:
    """``python -m cbteach serve ARGS``; returns the exit status."""
    args = parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        print(SERVE_EXTRA, file=sys.stderr)
        return 1
    if not is_loopback(args.host) and not args.api_key:
        print(f"refusing to listen on {args.host} without --api-key: anyone who can reach it could use the server "
              "(bind 127.0.0.1, or give a key)", file=sys.stderr)
        return 2
    if not 0 <= args.port < 65536:
        print(f"--port must be in 0..65535, got {args.port}", file=sys.stderr)
        return 2
    try:
        server = make_server(args)
    except (ValueError, OSError) as err:  # an unknown model, a bad engine option, a device that is not there
        print(f"cannot start: {err}", file=sys.stderr)
        return 2
    print(f"cbteach serving {args.served_model_name or args.model} on http://{args.host}:{args.port} "
          f"(live view at /, API at /v1{', key required' if args.api_key else ''}); Ctrl-C or SIGTERM stops it",
          file=sys.stderr, flush=True)
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
