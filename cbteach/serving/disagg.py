"""Disaggregated prefill and decode, simulated on one machine.

In a colocated engine a long prompt's prefill shares steps with everyone's decodes, so one arrival
stalls every running request's next token (an inter-token-latency spike), and decodes slow each
prefill down in turn. DistServe (Zhong et al., OSDI'24) and Splitwise (Patel et al., ISCA'24) put
the two phases on different GPUs: a **prefill engine** computes prompts and the first token, then
**hands the request's KV blocks over a link** to a **decode engine** that only ever decodes.

Here both engines are real :class:`~cbteach.engine.engine.Engine`\\ s with their own paged pools, run on
one machine in *simulated* time: each has a :class:`VirtualClock` that moves by what its steps
really took, and the two clocks run side by side as two GPUs would (whichever is behind steps
next). A handover copies the prompt's blocks out of the prefill pool (bytes counted) and arrives
in the decode engine ``bytes / link_bytes_per_s`` later, where it is taken in exactly like a
swapped-out request coming back (:meth:`~cbteach.kv.swap.HostCopies.swap_in_blocks`): the decode
engine's pool and manager do the work, attention is unchanged. Outputs are exact: the K/V moved are
the K/V computed.
"""
from __future__ import annotations

import math

from ..core.clock import VirtualClock
from ..engine.engine import Engine
from ..engine.scheduler_v0 import V0Scheduler
from ..core.request import Completion, Request, RequestStatus, Sequence
from ..core.validation import as_request_list


class DisaggregatedServer:
    """A prefill engine and a decode engine, each with its own pool, joined by a modelled link.

    ``link_bytes_per_s`` is the handover bandwidth (default 10 GB/s, between PCIe and NVLink).
    ``prefill_options``/``decode_options`` go to each :class:`Engine` (``num_blocks``, ``token_budget``...).
    ``step_time``: what a step costs on the simulated clocks (:class:`~cbteach.core.clock.VirtualClock`):
    ``None``, what it really took; a number of seconds, the same on every machine.
    """

    def __init__(self, model, tokenizer=None, *, max_batch_size: int = 8, block_size: int = 16,
                 link_bytes_per_s: float = 10e9, prefill_options: dict | None = None,
                 decode_options: dict | None = None, step_time=None):
        if not isinstance(link_bytes_per_s, (int, float)) or isinstance(link_bytes_per_s, bool) \
                or not link_bytes_per_s > 0 or math.isinf(link_bytes_per_s):
            raise ValueError(f"link_bytes_per_s must be a finite number > 0, got {link_bytes_per_s!r}")
        self.link_bytes_per_s = float(link_bytes_per_s)
        common = dict(max_batch_size=max_batch_size, kv="paged", block_size=block_size, keep_records=False)
        options = {}
        for phase, given in (("prefill", prefill_options), ("decode", decode_options)):
            if given is not None and not isinstance(given, dict):
                raise ValueError(f"{phase}_options must be a dict of Engine options, got {type(given).__name__}")
            reserved = sorted({"kv", "clock"} & set(given or {}))
            if reserved:
                raise ValueError(f"{phase}_options may not set {reserved}: both engines are paged and run on the "
                                 "server's simulated clocks")
            # Blocks are copied out as they are freed and taken in like V0's swapped-out ones: one process, no
            # step in flight, one sequence per request (checked here, not half-way through a run).
            wrong = {k: v for k, v in (given or {}).items()
                     if (k, v) in (("async_scheduling", True), ("parallel_sampling", "fork"))
                     or (k == "tensor_parallel_size" and v != 1)}
            if wrong:
                raise ValueError(f"{phase}_options {wrong} do not go with disaggregation: each engine copies K/V blocks "
                                 "in or out between steps, in one process, one sequence per request")
            # Each phase may be sized on its own (DistServe's point): its options override the common ones.
            options[phase] = {**common, **(given or {})}
        chosen = options["decode"].get("scheduler_cls")
        if chosen is not None and not (isinstance(chosen, type) and issubclass(chosen, V0Scheduler)):
            raise ValueError(f"decode_options scheduler_cls={getattr(chosen, '__name__', chosen)!r} cannot take handed-over "
                             "K/V: the decode engine takes them in the way V0's swapped-out blocks come back -- pass a "
                             "subclass of cbteach.engine.scheduler_v0.V0Scheduler, or leave it out")
        for key, default in (("block_size", block_size), ("kv_dtype", None)):  # blocks are copied as they are
            p, d = (options[ph].get(key, default) for ph in ("prefill", "decode"))
            if p != d:
                raise ValueError(f"the prefill and decode pools must have the same {key} (blocks are copied from one "
                                 f"to the other as they are); got {p!r} and {d!r}")
        self.prefill = Engine(model, tokenizer, clock=VirtualClock(step_time=step_time), **options["prefill"])
        # Handed-over K/V come back the way V0's swapped-out blocks do (V1 uses a KV connector instead).
        self.decode = Engine(model, tokenizer, clock=VirtualClock(step_time=step_time),
                             **{"scheduler_cls": V0Scheduler, **options["decode"]})
        self.prefill.on_release(self._hand_over)
        self.transfers = {"requests": 0, "bytes": 0, "seconds": 0.0}
        self._originals: dict[object, Request] = {}
        self.completions: dict[object, Completion] = {}

    def run(self, requests) -> list[Completion]:
        """Serve ``requests`` (arrival times in simulated seconds from the start of this call, as in
        :meth:`Engine.run`); completions in request order."""
        requests = as_request_list(requests, "DisaggregatedServer.run()")
        taken: set = set()
        for r in requests:  # refused up front: the prefill pool must hold the prompt and its first token, the
            if r.sampling_params.n > 1:  # decode pool the whole request
                raise ValueError(f"request {r.request_id!r} asks for n > 1 samples; the disaggregated simulation hands "
                                 "over one sequence per request")
            first = Request(r.prompt, 1, request_id=r.request_id, sampling_params=r.sampling_params)
            for phase, engine, asked in (("prefill", self.prefill, first), ("decode", self.decode, r)):
                try:
                    engine.check_request(asked, taken)
                except ValueError as err:
                    where = f" (the {phase} engine's pool: {phase}_options)" if "KV blocks" in str(err) else ""
                    raise ValueError(f"{err}{where}") from None
            taken.add(r.request_id)
        t_run = max(self.prefill.now(), self.decode.now())  # a later run starts where the last one ended
        for r in requests:
            self._originals[r.request_id] = r
            self.prefill.add_request(Request(r.prompt, 1, request_id=r.request_id,
                                             arrival_time=t_run + (r.arrival_time or 0.0), ignore_eos=r.ignore_eos,
                                             sampling_params=r.sampling_params))
        engines = (self.prefill, self.decode)
        while any(e.has_unfinished() for e in engines):
            busy = [e for e in engines if e.has_unfinished()]
            eng = min(busy, key=lambda e: e.now())  # the one behind in time goes next, as two GPUs would
            other = self.decode if eng is self.prefill else self.prefill
            if eng.step().idle:  # idle: jump to its next event (an arrival, a handover's bytes landing),
                nxt = eng.scheduler.next_event_time(eng.now())  # or catch up with the other engine
                target = nxt if nxt is not None else other.now()
                if target <= eng.now() and not other.has_unfinished():
                    raise RuntimeError("disaggregated serving made no progress; please report this")
                eng.clock.advance(target - eng.now() if target > eng.now() else 1e-6)
        for rid, c in self.prefill.completions.items():  # finished at their first token: never handed over
            if rid not in self.decode.sequences:
                self.completions[rid] = c
        self.completions.update(self.decode.completions)
        return [self.completions[r.request_id] for r in requests]

    def _hand_over(self, seq: Sequence) -> None:
        """The prefill engine frees a request's blocks: if it goes on decoding, ship its K/V first."""
        original = self._originals.get(seq.request_id)
        if original is None or seq.status is not RequestStatus.FINISHED or seq.finish_reason != "length" \
                or original.max_new_tokens == 1:  # (its one token ended it: EOS or a stop token)
            return
        data, nbytes = self.prefill.copy_kv_out(seq)
        seconds = nbytes / self.link_bytes_per_s
        self.transfers["requests"] += 1
        self.transfers["bytes"] += nbytes
        self.transfers["seconds"] += seconds
        # The decode engine takes it in like a swapped-out request coming back, once the bytes arrive.
        moved = Sequence(request=original, prompt_ids=list(seq.prompt_ids), arrival_time=seq.arrival_time,
                         output_ids=list(seq.output_ids), num_computed_tokens=seq.num_computed_tokens,
                         first_token_time=seq.first_token_time, token_times=list(seq.token_times),
                         ready_time=self.prefill.now() + seconds, generator_state=self.prefill.executor.generator_state(seq.request_id),
                         num_cached_prompt_tokens=seq.num_cached_prompt_tokens)
        self.decode.receive(moved, data)
