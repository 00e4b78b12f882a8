"""``python -m cbteach serve``: the engine behind an OpenAI-compatible HTTP API, as vLLM V1 serves (notebook 11).

Continuous batching is a serving technique: its point is that a chat message arriving while others
are being answered joins the running batch at the next step instead of waiting for the batch to
drain. This module puts the course's engine where that happens, split the way vLLM V1 splits it:

* an **API server** -- this process: FastAPI routes on uvicorn (:mod:`.server_app`,
  :mod:`.server_routes`) that speak OpenAI's protocol (:mod:`.openai_protocol`), validate and
  tokenize (:mod:`.tokenization`), detokenize each step's new ids incrementally
  (:mod:`.detokenizer`, :mod:`.output_processor`), and keep ``/metrics`` and the live view;
* one or more **engine cores** -- processes of their own (:mod:`.engine_core`), each a busy loop of
  schedule, execute, update around one :class:`~cbteach.Engine`, that exchange requests, aborts
  and one message of outputs per step with the API server over ZeroMQ in msgpack
  (:mod:`.core_messages`, :mod:`.core_client`).

So the event loop that writes the streams and the loop that steps the engine no longer share an
interpreter lock. ``--data-parallel-size N`` starts N cores, each with its own model copy and KV
pool, and routes each request to the least loaded: N times the batch slots and the pool, for N
times the memory -- it scales throughput when one core's batch is full, not the speed of one
request. Tensor parallelism (``--tensor-parallel-size``) is the other way: one model split over
processes, so one step's work is shared, each process holds part of the weights, and a model too
big for one device fits -- at the cost of communication inside every layer (Megatron-LM).

Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (streamed or not), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus, vLLM's names; :mod:`.server_metrics`), and ``GET /``,
the live view of every core's batch (:mod:`.server_live`).

Safe by default: it binds to 127.0.0.1; ``--api-key`` (or ``CBTEACH_API_KEY``) guards every route
but ``/health``, and a non-loopback ``--host`` refuses to start without a key. Requests are capped
(``--max-tokens-cap``, ``--max-n``, ``--max-body-bytes``, ``--max-in-flight``), and so are slow
clients (``--header-timeout``, ``--body-timeout``, ``--max-connections``; :mod:`.server_http`).
The port is bound before anything starts (a port in use fails at once; ``--port 0`` announces the
port it got). SIGTERM (or Ctrl-C) stops taking requests, lets in-flight ones finish for up to
``--drain-timeout`` seconds, aborts the rest, stops the cores and exits 0 at once (a second signal aborts
the rest now). A signal before the server serves -- while the cores load -- stops the start-up where it
is and kills the cores (:class:`StartupSignals`); and the cores end whenever this process does,
whatever they are doing (:mod:`.parent_death`). If an engine core dies,
the requests it held get an error at once, ``/health`` turns 503, new requests are refused, the
other cores' requests finish (the same drain), and the server exits 1.

Long prompts are prefilled in chunks by default (``--token-budget``, Sarathi-Serve's chunked prefill).
What the operator reads -- the banner's KV cache and concurrency, failed requests, drains, periodic
stats (``--stats-interval``), never a key -- is :mod:`.server_logs`.
"""
from __future__ import annotations

import ipaddress
import os
import signal
import socket
import sys
import threading
import time

from .server_cli import parser  # noqa: F401  (part of this module's API)

PROCESS_ENTRY = False  # set where ``serve`` is the process itself (python -m ...): it may end it at once
SERVE_EXTRA = "cbteach serve needs FastAPI, uvicorn and prometheus_client: pip install 'cbteach[serve]'"
LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now -- so a port in use fails before anything starts, and ``--port 0``
    knows its real port before it says where it serves."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    if os.name == "posix":
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)  # connections queue from now on, even while uvicorn starts
    except OSError:
        sock.close()
        raise
    return sock


def check_pieces(args) -> None:
    """Every ``--scheduler``/``--kv-manager``/``--attention``/``--slot-mapping``/``--update-batch`` imports
    (ValueError if not)."""
    from .engine_core import PIECES, load_piece

    for name in PIECES:
        if getattr(args, name):
            load_piece(getattr(args, name), name)


def make_server(args, frontend, sock):
    """A uvicorn server around a started front end (not running yet)."""
    import uvicorn

    from .server_app import create_app
    from .server_http import guarded_protocol, server_class
    from .server_logs import setup

    server = None
    app = create_app(frontend, on_startup=lambda: frontend.client.__setattr__(
        "on_dead", lambda why: server.exit_soon(why)))
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=args.drain_timeout + 5,
                            access_log=args.log_level in ("info", "debug"), timeout_keep_alive=5,
                            http=guarded_protocol(args.header_timeout, args.max_connections))
    setup(args.log_level)  # (after uvicorn's Config, which sets up uvicorn's own loggers)
    server = server_class()(config)
    server.frontend, server.drain_timeout, server.sock = frontend, args.drain_timeout, sock
    return server


def start(args, check=None):
    """Bind, start the engine cores and build the server: ``(server, url)``; ValueError/OSError saying why not.
    ``check()`` is called while the cores load (it may raise to stop the start-up: the cores are then killed)."""
    from .core_client import CoreStartError
    from .frontend import start_frontend

    check_pieces(args)
    try:
        sock = bind(args.host, args.port)
    except OSError as err:
        raise OSError(f"cannot listen on {args.host}:{args.port}: {err.strerror or err}") from None
    try:
        frontend = start_frontend(args, args.startup_timeout, check)
    except (CoreStartError, ValueError) as err:
        sock.close()
        raise ValueError(str(err)) from None
    except BaseException:  # a signal (Stopped), Ctrl-C: start_frontend has stopped the cores
        sock.close()
        raise
    try:
        host, port = sock.getsockname()[:2]
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        return make_server(args, frontend, sock), url
    except BaseException:
        frontend.client.close(grace=0)
        sock.close()
        raise


class ServerThread:
    """The server's HTTP side in a background thread of this process, its engine cores in their own
    processes (tests, and a notebook that wants no server subprocess).

    ``ServerThread(["--port", "0", ...]).start()`` returns once it answers; ``.url`` is its address;
    ``.stop()`` shuts it down as SIGTERM would (bounded)."""

    def __init__(self, argv=()):
        self.args = parser().parse_args(list(argv))
        self.server, self.url = start(self.args)
        self.frontend = self.server.frontend
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.server.sock]},
                                       name="cbteach-serve", daemon=True)

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self.thread.is_alive():
            self.server.handle_exit(None, None)
            self.thread.join(timeout)
        self.frontend.client.close()  # whatever happened, no engine core outlives this

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class Stopped(BaseException):
    """A signal to stop arrived before the server was serving (while the engine cores load)."""


class StartupSignals:
    """SIGINT and SIGTERM from the first moment: until the server serves, a signal is noted, and the start-up
    stops at its next check (:meth:`check` raises :class:`Stopped`) -- at least ten times a second while the
    cores load -- and the cores are killed; once uvicorn runs, its handlers take over (drain, then stop).

    Noted, not raised from the handler: an exception raised in the middle of an import can leave the
    import system's locks held and the process hung. Installed explicitly because a process may inherit
    SIGINT ignored (a shell's background job does), and then Python sets no handler of its own: Ctrl-C
    would be ignored until uvicorn installs its own."""

    def __init__(self):
        self.armed = threading.current_thread() is threading.main_thread()
        self.old = {}
        self.received = None  # the first signal's name
        if self.armed:
            self.old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, sig, frame) -> None:
        if self.armed and self.received is None:
            self.received = signal.Signals(sig).name

    def check(self) -> None:
        """Raise :class:`Stopped` if a signal came (once: the cleanup it starts is not interrupted)."""
        if self.armed and self.received is not None:
            self.armed = False
            raise Stopped(self.received)

    def restore(self) -> None:
        self.armed = False
        for s, handler in self.old.items():
            signal.signal(s, handler)


def main(argv=None) -> int:
    """``python -m cbteach serve ARGS``; returns the exit status."""
    signals = StartupSignals()
    try:
        return _main(argv, signals)
    except Stopped as stop:
        print(f"stopped by {stop} before serving; no engine core is left running", file=sys.stderr)
        if PROCESS_ENTRY:
            sys.stderr.flush()
            os._exit(0)
        return 0
    finally:
        signals.restore()


def _main(argv, signals: StartupSignals) -> int:
    from .server_cli import check_mode

    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser()
    args = p.parse_args(argv)
    check_mode(p, args, argv)
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        print(SERVE_EXTRA, file=sys.stderr)
        return 1
    if not is_loopback(args.host) and not args.api_key:
        print(f"refusing to listen on {args.host} without --api-key: anyone who can reach it could use the server "
              "(bind 127.0.0.1, or give a key)", file=sys.stderr)
        return 2
    signals.check()
    try:
        server, url = start(args, signals.check)
    except (ValueError, OSError) as err:  # a port in use, an unknown model, a bad option or piece
        print(f"cannot start: {err}", file=sys.stderr)
        return 2
    cores = args.data_parallel_size
    print(f"cbteach serving {args.served_model_name or args.model} on {url} ({cores} engine core"
          f"{'s' if cores > 1 else ''}; live view at /, API at /v1{', key required' if args.api_key else ''}); "
          "Ctrl-C or SIGTERM stops it", file=sys.stderr, flush=True)
    from .server_logs import banner_lines

    for line in banner_lines(args, server.frontend.client.ready):
        print(line, file=sys.stderr, flush=True)
    try:
        signals.check()  # (from here on, uvicorn's handlers: the drain)
        server.startup_signals = signals
        server.run(sockets=[server.sock])
    finally:
        signals.armed = False  # the cleanup below is bounded: a signal now must not cut it short
        server.frontend.client.close()
    dead = server.frontend.client.dead
    if dead is not None:
        print(f"stopped: {dead}", file=sys.stderr)
    code = 1 if dead is not None or not server.started else 0
    if PROCESS_ENTRY:  # everything is stopped and said: skip the interpreter's teardown (torch's takes seconds)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    PROCESS_ENTRY = True
    raise SystemExit(main(sys.argv[1:]))
