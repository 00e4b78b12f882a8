"""The API server's state: its engine cores, their outputs, the checks, the metrics and the live view.

:func:`start_frontend` does what ``python -m cbteach serve`` does before it listens: it starts the
engine cores (:class:`~.core_client.CoreClient`; each loads the model in its own process), waits
until every one is ready, loads the tokenizer here -- the cores never see text -- and returns a
:class:`Frontend` that the HTTP routes (:mod:`.server_app`) share.
"""
from __future__ import annotations

import itertools
import time

from . import core_messages as msg
from . import openai_protocol as proto
from .core_client import CoreClient
from .detokenizer import IncrementalDetokenizer
from .engine_core import CoreSpec
from .output_processor import OutputProcessor, RequestState
from .server_live import LiveHub
from .server_logs import ServeLog, StatsLogger
from .server_metrics import ServerMetrics
from .tokenization import PromptChecker, load_tokenizer


def core_spec(args) -> CoreSpec:
    """The engine options of parsed ``serve`` arguments, as an engine core takes them."""
    options = {"max_batch_size": args.max_batch_size, "kv": args.kv, "token_budget": args.token_budget,
               "policy": args.policy, "preemption": args.preemption}
    if args.speculative == "ngram":
        options["speculative"] = "ngram"
    if args.speculative:
        options["num_speculative_tokens"] = args.num_speculative_tokens
    if args.kv == "paged":
        options.update(block_size=args.block_size, prefix_caching=args.prefix_caching)
        for name in ("num_blocks", "kv_memory_bytes"):
            if getattr(args, name) is not None:
                options[name] = getattr(args, name)
    if args.tensor_parallel_size != 1:
        options["tensor_parallel_size"] = args.tensor_parallel_size
    pieces = {k: getattr(args, k) for k in ("scheduler", "kv_manager", "attention", "slot_mapping", "update_batch")
              if getattr(args, k)}
    return CoreSpec(index=0, input_address="", output_address="", parent_pid=0, model=args.model, device=args.device,
                    threads=args.threads, engine_options=options, pieces=pieces,
                    speculative_model=args.speculative if args.speculative not in (None, "ngram") else None,
                    fault_injection=args.fault_injection)


class Frontend:
    """Everything the routes share; all of it lives on the event loop (no locks)."""

    def __init__(self, args, client: CoreClient, tokenizer):
        ready = client.ready[0]
        self.client, self.processor, self.tokenizer = client, client.processor, tokenizer
        self.name = args.served_model_name or args.model
        if args.default_max_tokens is not None and args.default_max_tokens >= ready.max_positions:
            raise ValueError(f"--default-max-tokens {args.default_max_tokens} leaves no room for a prompt in the "
                             f"model's {ready.max_positions} positions")
        if args.max_tokens_cap is not None and args.max_tokens_cap >= ready.max_positions:
            raise ValueError(f"--max-tokens-cap {args.max_tokens_cap} leaves no room for a prompt in the model's "
                             f"{ready.max_positions} positions: at most {ready.max_positions - 1}")
        cap = args.max_tokens_cap or ready.max_positions - 1  # (a prompt takes one position at least)
        self.limits = proto.Limits(served_model=self.name, max_tokens_cap=cap,
                                   max_n=args.max_n, default_max_tokens=args.default_max_tokens,
                                   default_temperature=ready.default_temperature, vocab_size=ready.vocab_size)
        self.max_model_len = ready.max_positions
        self.checker = PromptChecker(tokenizer, ready.max_positions, ready.vocab_size)
        self.metrics = ServerMetrics(self.name, client.num_cores)
        self.hub = LiveHub(ready.max_batch_size, client.num_cores, max_listeners=args.max_live_listeners)
        self.processor.metrics, self.processor.hub = self.metrics, self.hub
        self.log = ServeLog(self)
        self.processor.on_failed = self.log.failed
        self.stats = StatsLogger(self.metrics, args.stats_interval)
        self.api_key = args.api_key
        self.max_body_bytes = args.max_body_bytes
        self.max_in_flight = args.max_in_flight
        self.body_timeout = args.body_timeout
        self.fault_injection = args.fault_injection
        self.draining = False
        self._ids = itertools.count()

    @property
    def num_in_flight(self) -> int:
        return len(self.processor.states)

    def check_open(self, choices: int) -> None:
        if self.client.dead is not None:
            raise proto.APIError(503, f"the server cannot serve: {self.client.dead}", type="server_error",
                                 code="engine_dead")
        if self.draining:
            raise proto.APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
        if self.num_in_flight + choices > self.max_in_flight:
            raise proto.APIError(503, f"the server has {self.num_in_flight} requests in flight; this one's {choices} "
                                 f"would pass its limit of {self.max_in_flight} (--max-in-flight); retry later",
                                 type="server_error", code="server_overloaded", retry_after=1)

    def submit(self, req: proto.GenerationRequest, index: int, ids: list, sampling, queue, created: float,
               fail_after: int | None = None, http_id: str = "") -> RequestState:
        """Route one choice to a core; its events arrive on ``queue``."""
        detok = IncrementalDetokenizer(self.tokenizer, req.stop, req.stop_token_ids)
        st = RequestState(f"r{next(self._ids)}", ids, req.max_tokens, detok, queue, index, created=created,
                          http_id=http_id)
        self.client.submit(st, msg.AddRequest(st.request_id, ids, req.max_tokens, sampling.temperature, sampling.top_p,
                                              sampling.seed, req.ignore_eos, fail_after, req.stop_token_ids,
                                              req.priority))
        return st

    def abort_all(self) -> None:
        """Shutdown after the drain timeout: every request still in flight is dropped in its core and ends here."""
        states = list(self.processor.states.values())
        self.log.drain_aborting(states)
        for st in states:
            self.client.abort(st)

    def close(self) -> None:
        self.checker.close()


def start_frontend(args, startup_timeout: float = 300.0, check=None) -> Frontend:
    """Start the engine cores for parsed ``serve`` arguments, wait until they are ready, and build the front end.
    Raises :class:`~.core_client.CoreStartError` (or ``ValueError``) saying why it cannot start."""
    client = CoreClient(core_spec(args), OutputProcessor(), args.data_parallel_size)
    t = time.perf_counter()
    try:
        client.start(startup_timeout, check)
        try:
            tokenizer = load_tokenizer(args.model)
        except (OSError, ValueError) as err:
            raise ValueError(f"cannot load the tokenizer of {args.model!r}: {err}") from None
        if check is not None:
            check()
        frontend = Frontend(args, client, tokenizer)
    except BaseException:  # a bad tokenizer, a signal while the cores load: none of them is left running
        client.close(grace=0)
        raise
    frontend.startup_s = time.perf_counter() - t
    return frontend
