"""``python -m cbteach serve``'s options: the server, its engine cores, each request's caps, the network's limits.

The engine options are :class:`cbteach.Engine`'s, passed to every engine core. Five more plug the
learner's own pieces into each core's engine (notebook 12): ``--scheduler MODULE:CLASS`` (a
:class:`~cbteach.engine.scheduler.Scheduler` subclass), ``--kv-manager MODULE:CLASS`` (built as
``CLASS(num_blocks, block_size)``), ``--attention MODULE:FUNCTION``, ``--slot-mapping
MODULE:FUNCTION`` and ``--update-batch MODULE:FUNCTION`` (the worker's update, one process only) --
imported as Python imports them (the current folder is on the path).
"""
from __future__ import annotations

import argparse
import os

from ..argtypes import threads

DEFAULT_TOKEN_BUDGET = 256  # chosen by benchmarks/serve/token_budget.py: see its README
PAGED_ONLY = {"num_blocks": "--num-blocks", "kv_memory_bytes": "--kv-memory-bytes", "block_size": "--block-size",
              "prefix_caching": "--prefix-caching", "kv_manager": "--kv-manager", "attention": "--attention",
              "slot_mapping": "--slot-mapping", "preemption": "--preemption"}  # (concat never preempts)
_UNSET = object()


def given(make_parser, argv, dests) -> list:
    """Which of ``dests`` the command line ``argv`` set -- to any value, even the default's (``make_parser()``
    parses it again with every one of them defaulting to a marker)."""
    p = make_parser()
    p.set_defaults(**dict.fromkeys(dests, _UNSET))
    ns = p.parse_args(list(argv))
    return [d for d in dests if getattr(ns, d) is not _UNSET]


def check_mode(p: argparse.ArgumentParser, args, argv) -> None:
    """Options that do not apply to the chosen mode, or contradict each other, are refused (``p.error``), never
    silently ignored."""
    if args.kv == "concat":
        wrong = given(parser, argv, PAGED_ONLY)
        if wrong:
            p.error(f"{', '.join(PAGED_ONLY[d] for d in wrong)} appl{'y' if len(wrong) > 1 else 'ies'} to the paged "
                    "KV cache only; --kv concat has no blocks (drop the option, or use --kv paged)")
    if args.speculative is not None and not args.speculative.strip():
        p.error("--speculative must not be empty: give ngram (prompt lookup) or a draft model's name, or leave it out")
    if args.log_level not in ("info", "debug") and given(parser, argv, ["stats_interval"]):
        p.error(f"--stats-interval sets how often a stats line is logged at --log-level info (or debug); at "
                f"--log-level {args.log_level} none is: add --log-level info, or drop --stats-interval")
    processes, cores = args.data_parallel_size * args.tensor_parallel_size, os.cpu_count() or 1
    if processes > 4 * cores:
        p.error(f"--data-parallel-size {args.data_parallel_size} x --tensor-parallel-size "
                f"{args.tensor_parallel_size} is {processes:,} model processes, more than 4 per core of this "
                f"machine's {cores}: each holds a copy (or a shard) of the model")
    if args.speculative is None and given(parser, argv, ["num_speculative_tokens"]):
        p.error("--num-speculative-tokens sets how many tokens speculation guesses per step, and no --speculative "
                "was given: add --speculative ngram (or a draft model), or drop --num-speculative-tokens")
    if args.num_blocks is not None and args.kv_memory_bytes is not None:
        p.error("give --num-blocks or --kv-memory-bytes, not both (each sizes the KV pool)")
    if args.default_max_tokens is not None and args.max_tokens_cap is not None \
            and args.default_max_tokens > args.max_tokens_cap:
        p.error(f"--default-max-tokens {args.default_max_tokens} is more than --max-tokens-cap {args.max_tokens_cap}: "
                "a request that gives no max_tokens would be refused")
    if args.max_n > args.max_in_flight:
        p.error(f"--max-n {args.max_n} is more than --max-in-flight {args.max_in_flight}: a request with that many "
                "choices could never be taken")
    if args.update_batch and args.tensor_parallel_size != 1:
        p.error("--update-batch runs in the engine core's own process; with --tensor-parallel-size > 1 every rank "
                "runs the worker's own update (drop one of the two)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"must be in 0..65535 (0: any free port), got {value}")
    return value


def _device(text: str) -> str:
    """``--device``, checked here (the engine cores take the name): cpu, cuda[:N], mps or auto, on this machine."""
    from ..models import device_option

    try:
        device_option(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value}")
    return value


def _name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty (clients send it as 'model')")
    if text != text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} has spaces at an end, which a client's 'model' must then "
                                         "match exactly: give the name without them")
    return text


def _host(text: str) -> str:
    """``--host``: a name or an address to bind; an IPv6 address may be bracketed as in a URL (``[::1]``)."""
    host = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    if not host.strip() or host != host.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not a host name or address (e.g. 127.0.0.1, ::1, 0.0.0.0)")
    return host


def _api_key(text: str) -> str:
    """``--api-key`` (or ``$CBTEACH_API_KEY``): a key a client can send -- an empty one would lock every client out."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty (no client can send an empty key, so none could get in): "
                                         "give a key, or unset CBTEACH_API_KEY to serve without one")
    if text != text.strip():
        raise argparse.ArgumentTypeError("must not start or end with a space (clients' headers drop it)")
    return text


def _token_budget(text: str):
    """``--token-budget``: a whole number of tokens >= 1, or ``none`` (no limit: every prompt in one step)."""
    if text.strip().lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens >= 1 or 'none', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number of tokens >= 1 or 'none', got {value}")
    return value


class DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" to an option's help unless the help already says its default (or it has none)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cbteach serve", formatter_class=DefaultsOnce,
                                description="Serve a model with cbteach's continuous-batching engine behind an "
                                            "OpenAI-compatible API, with a live view of the batch at /. The engine "
                                            "runs in engine-core processes of its own (vLLM V1's split).")
    p.add_argument("--model", default="bierce", help="bierce (embedded, offline), bierce-draft, or a hub id / folder")
    p.add_argument("--served-model-name", type=_name, default=None, help="the name clients use in 'model' (default: --model)")
    p.add_argument("--host", type=_host, default="127.0.0.1", help="address to bind; anything but loopback needs --api-key")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on (0: any free port, announced at start)")
    p.add_argument("--api-key", type=_api_key, default=os.environ.get("CBTEACH_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health; the live view opens as "
                        "/?key=KEY (default: $CBTEACH_API_KEY, else none)")
    p.add_argument("--device", type=_device, default="cpu", help="cpu, cuda, mps, or auto (the best this machine has)")
    p.add_argument("--threads", type=threads, default=1, help="torch CPU threads of each engine core")
    p.add_argument("--data-parallel-size", type=_positive_int, default=1,
                   help="engine cores, each with its own model copy and KV pool; requests go to the least loaded")
    p.add_argument("--tensor-parallel-size", type=_positive_int, default=1,
                   help="processes that share each engine core's model, split by layers' heads (Megatron-LM)")
    e = p.add_argument_group("engine (the same options as cbteach.Engine)")
    e.add_argument("--kv", choices=("paged", "concat"), default="paged", help="KV cache")
    e.add_argument("--max-batch-size", type=_positive_int, default=8, help="most requests in one step (batch slots)")
    e.add_argument("--token-budget", type=_token_budget, default=DEFAULT_TOKEN_BUDGET, metavar="N|none",
                   help="most tokens in one step (vLLM's max_num_batched_tokens): a longer prompt is prefilled in "
                        "chunks, so streams already running still get a token every step (Sarathi-Serve's chunked "
                        f"prefill); 'none' prefills every prompt in one step (default: {DEFAULT_TOKEN_BUDGET})")
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
    g = p.add_argument_group("your own pieces in the engine (notebook 12)")
    g.add_argument("--scheduler", default=None, metavar="MODULE:CLASS", help="a Scheduler subclass")
    g.add_argument("--kv-manager", default=None, metavar="MODULE:CLASS",
                   help="a KV manager class, built as CLASS(num_blocks, block_size) (paged)")
    g.add_argument("--attention", default=None, metavar="MODULE:FUNCTION",
                   help="fn(query, key, value, meta, layer, scaling) (paged)")
    g.add_argument("--slot-mapping", default=None, metavar="MODULE:FUNCTION",
                   help="fn(block_tables, num_computed_tokens, num_scheduled_tokens, block_size) (paged)")
    g.add_argument("--update-batch", default=None, metavar="MODULE:FUNCTION",
                   help="fn(runner, scheduler_output): the worker's update of its batch (notebook 06b; one process)")
    c = p.add_argument_group("per-request caps")
    c.add_argument("--max-tokens-cap", type=_positive_int, default=None,
                   help="the largest max_tokens a request may ask (default: the model's positions)")
    c.add_argument("--default-max-tokens", type=_positive_int, default=None,
                   help="max_tokens of a request that gives none (default: none, the field is required)")
    c.add_argument("--max-n", type=_positive_int, default=8, help="most choices (n x prompts) in one request")
    c.add_argument("--max-body-bytes", type=_positive_int, default=1 << 20, help="largest request body")
    c.add_argument("--max-in-flight", type=_positive_int, default=512,
                   help="requests (choices) queued or running at once; more get 503")
    n = p.add_argument_group("the network's limits")
    n.add_argument("--header-timeout", type=_positive_float, default=10.0,
                   help="seconds a connection has to send a request's headers; slower ones get 408 and are closed")
    n.add_argument("--body-timeout", type=_positive_float, default=30.0,
                   help="seconds a request's body may take to arrive; slower ones get 408")
    n.add_argument("--max-connections", type=_positive_int, default=1024,
                   help="open connections at once; one more gets 503 and is closed")
    n.add_argument("--max-live-listeners", type=_positive_int, default=16,
                   help="live-view pages streaming at once; one more gets 503")
    p.add_argument("--drain-timeout", type=_positive_float, default=4.0,
                   help="on SIGTERM or Ctrl-C, seconds in-flight requests may take to finish before they are aborted "
                        "(default 4: with the abort and the engine cores' stop, the server is gone within 5 s)")
    p.add_argument("--startup-timeout", type=_positive_float, default=300.0,
                   help="seconds the engine cores may take to load the model")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="what the server logs: 'warning' (the default) says what failed and what a drain aborted; "
                        "'info' adds the periodic stats and one access line per request (keys never logged)")
    p.add_argument("--stats-interval", type=_positive_float, default=10.0,
                   help="seconds between two stats lines at --log-level info (running, waiting, KV use, tokens/s)")
    p.add_argument("--fault-injection", action="store_true", help=argparse.SUPPRESS)  # tests: cbteach_fail_after
    return p
