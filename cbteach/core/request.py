"""Requests in, completions out -- and the validation that keeps bad input away from the engine.

A :class:`Request` is what a user asks for: a prompt and how many tokens they are willing to wait
for. A :class:`Completion` is what they get back. In between, the engine keeps a
:class:`Sequence`: the request's live state, above all ``num_computed_tokens`` -- how many of its
tokens already have keys and values in the KV cache. Everything a scheduler decides is phrased in
terms of that number: tokens ``[num_computed_tokens:]`` of ``prompt + output`` still have to go
through the model.

Validation happens when a request is *added* (see :func:`validate_request`), never mid-run, so a
bad request is refused with a ``ValueError`` before it can disturb requests already running.
"""
from __future__ import annotations

import enum
import itertools
import math
import numbers
from dataclasses import KW_ONLY, dataclass, field
from typing import Sequence as Seq

from .sampling import GREEDY, SamplingParams

_auto_ids = itertools.count()


@dataclass
class Request:
    """One generation request.

    ``prompt`` is a string (needs a tokenizer) or a list of token ids. ``max_new_tokens`` caps the
    output; the model may stop earlier by producing EOS, unless ``ignore_eos`` (for benchmarks that
    need long, predictable outputs). ``arrival_time`` (seconds after the engine starts) and
    ``priority`` are for schedulers that care about them. Without a ``request_id`` one is made up.
    Nothing is checked here: the engine checks a request when it is added.
    """

    prompt: str | Seq[int]
    max_new_tokens: int
    _: KW_ONLY
    request_id: object = None
    arrival_time: float | None = None
    priority: int = 0
    ignore_eos: bool = False
    sampling_params: SamplingParams = GREEDY

    def __post_init__(self):
        if self.request_id is None:
            self.request_id = f"req-{next(_auto_ids)}"


@dataclass
class Completion:
    """The result of one request. ``output_ids`` ends with the EOS id when ``finish_reason == "eos"``.

    Times are seconds on the engine's clock (since the engine was created): ``first_token_time -
    arrival_time`` is the time to first token (TTFT); gaps between ``token_times`` are
    inter-token latencies.
    """

    request_id: object
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    text: str | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    num_cached_prompt_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (vLLM's num_cached_tokens)
    samples: list | None = None  # n > 1: one Completion per sample (request_id (id, i)); output_ids are sample 0's
    error: str | None = None  # finish_reason "error": what went wrong for this request alone

    @classmethod
    def of(cls, seq, tokenizer, now: float) -> Completion:
        """What a finished (or aborted) sequence gives back."""
        text = None if tokenizer is None else tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        return cls(request_id=seq.request_id, prompt_ids=list(seq.prompt_ids), output_ids=list(seq.output_ids),
                   finish_reason=seq.finish_reason, text=text, arrival_time=seq.arrival_time,
                   first_token_time=seq.first_token_time, token_times=list(seq.token_times), finish_time=now,
                   num_cached_prompt_tokens=seq.num_cached_prompt_tokens, error=seq.error)

    @classmethod
    def of_samples(cls, samples: list[Completion], now: float) -> Completion:
        """A request with ``n > 1`` samples: sample 0's fields, under the request's id, and every sample."""
        first = samples[0]
        return cls(request_id=first.request_id[0], prompt_ids=first.prompt_ids, output_ids=first.output_ids,
                   finish_reason=first.finish_reason, text=first.text, arrival_time=first.arrival_time,
                   first_token_time=min((c.first_token_time for c in samples if c.first_token_time is not None),
                                        default=None),
                   token_times=first.token_times, finish_time=now,
                   num_cached_prompt_tokens=first.num_cached_prompt_tokens, samples=samples,
                   error=next((c.error for c in samples if c.error is not None), None))

    def __repr__(self) -> str:
        shown = repr(self.text[:40] + ("…" if len(self.text) > 40 else "")) if self.text is not None else ""
        return (f"Completion({self.request_id!r}, {len(self.prompt_ids)} prompt + "
                f"{len(self.output_ids)} new tokens, {self.finish_reason}{', ' + shown if shown else ''})")


class RequestStatus(enum.Enum):
    """Where a request is in its life. Only the scheduler moves a request from one to the next."""

    WAITING = "waiting"  # queued, never run (or not arrived yet)
    RUNNING = "running"  # in the batch: it has a slot and KV blocks
    PREEMPTED = "preempted"  # taken out of the batch to free KV room; queued again, to be recomputed
    SWAPPED = "swapped"  # taken out of the batch, its K/V blocks copied to host memory until room returns
    FINISHED = "finished"  # stopped at EOS or max_new_tokens
    ABORTED = "aborted"  # cancelled by Engine.abort

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.ABORTED)


@dataclass(eq=False)
class Sequence:
    """A request's live state inside the engine, grouped as transformers' ``RequestState`` groups it.

    ``num_computed_tokens`` is the number everything turns on: tokens ``[0, num_computed_tokens)``
    of ``prompt + output`` have their keys and values in the KV cache; the rest must still go
    through the model.
    """

    # -- identity: what was asked ----------------------------------------------------------------
    request: Request
    prompt_ids: list[int]
    generator_state: bytes | None = None  # a handed-over seeded request's random stream (its runner keeps the generator)
    claimed: bool = False  # added by run() or stream(), which report on it themselves (streams skip it)
    # -- scheduling: where it is, how far it got ---------------------------------------------------
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    slot: int | None = None  # which batch slot (timeline row) it occupies -- not a KV slot of a slot_mapping
    finish_reason: str | None = None  # "eos", "stop", "length", "aborted" or "error" once finished
    error: str | None = None  # finish_reason "error": what went wrong for this request alone
    num_preemptions: int = 0
    num_placeholders: int = 0  # async scheduling: tokens a step in flight will give it, not appended yet
    # -- KV: its room in the cache (paged) -----------------------------------------------------------
    block_table: list[int] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    ready_time: float = 0.0  # swapped-in K/V usable from this time on (a disaggregated handover's arrival)
    # -- speculative decoding ----------------------------------------------------------------------
    draft_ids: list[int] = field(default_factory=list)  # guesses for the next step
    # -- parallel sampling (n > 1): one prompt, several samples sharing its KV blocks -----------------
    sample_index: int | None = None  # which sample of its request (None: the request has one)
    forks: list = field(default_factory=list)  # samples waiting for this one's prefill, to share its blocks
    completion: object = None  # its own Completion once finished (the request's gathers every sample's)
    # -- timing, on the engine's clock ---------------------------------------------------------------
    arrival_time: float = 0.0
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def request_id(self):
        """The request's id -- or ``(request_id, i)`` for sample ``i`` of a request with ``n > 1``."""
        rid = self.request.request_id
        return rid if self.sample_index is None else (rid, self.sample_index)

    @property
    def num_slots(self) -> int:
        """Batch slots it needs: its own, and one per sample that will fork from it."""
        return 1 + len(self.forks)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens ``start..end-1`` of prompt + output, without building the whole list every step."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[max(0, start - p) : end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Known tokens plus the ones a step in flight will give it (async scheduling; else the same)."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_placeholders

    @property
    def is_decoding(self) -> bool:
        """It has sampled a token and everything before that token is computed: next it feeds that
        one token (plus any guesses). Anything else -- a prompt, a chunk of one, recomputing after a
        preemption -- is a prefill."""
        return bool(self.output_ids or self.num_placeholders) and \
            self.num_computed_tokens == self.num_tokens_with_placeholders - 1

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, prompt={len(self.prompt_ids)}, out={len(self.output_ids)}, "
                f"computed={self.num_computed_tokens})")


# Arrival times are seconds on the engine's clock; 10**8 s is over three years. A larger value is a
# clock reading such as time.time() (about 1.8e9 today), which would make run() sleep for decades.
ABSOLUTE_TIME = 1e8


def check_positive_int(name: str, value) -> None:
    """Raise ``ValueError`` unless ``value`` is an integer >= 1 (``True`` is not a size)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def as_request_list(requests, where: str) -> list:
    """``requests`` as a list, or a ``ValueError`` that says what ``where`` takes (the items themselves
    are checked one by one by :func:`validate_request`)."""
    if isinstance(requests, Request):
        raise ValueError(f"{where} takes a list of Requests; for one request pass [request]")
    if isinstance(requests, (str, bytes)) or not hasattr(requests, "__iter__"):
        raise ValueError(f"{where} takes a list of Requests, got {type(requests).__name__}")
    return list(requests)


def validate_request(request, *, tokenizer, vocab_size: int, max_pos: int | None) -> list[int]:
    """Check a request and return its prompt as token ids; raise ``ValueError`` saying what is wrong.

    Checked: the prompt's type, that it is not empty, that its ids and its ``stop_token_ids`` are
    inside the vocabulary, that ``max_new_tokens`` is an integer >= 1, and that prompt +
    ``max_new_tokens`` fits in the model's positions.
    """
    if not isinstance(request, Request):
        raise ValueError(f"expected a cbteach.Request, got {type(request).__name__}")
    rid = request.request_id
    try:
        hash(rid)
    except TypeError:
        raise ValueError(f"request_id must be hashable (a str or an int, say), got {type(rid).__name__}") from None
    at = request.arrival_time
    if at is not None and (not isinstance(at, numbers.Real) or isinstance(at, bool) or not math.isfinite(at)
                           or at < 0):
        raise ValueError(f"request {rid!r}: arrival_time must be None (now) or a finite number of seconds >= 0, "
                         f"got {at!r}")
    if at is not None and at >= ABSOLUTE_TIME:
        raise ValueError(f"request {rid!r}: arrival_time={at!r} looks like an absolute clock time (time.time()); "
                         "arrival_time counts seconds after the engine starts (add_request) or after run() is "
                         "called -- pass None for 'now', or time.time() - your start time")
    if not isinstance(request.sampling_params, SamplingParams):
        raise ValueError(f"request {rid!r}: sampling_params must be a cbteach.SamplingParams, "
                         f"got {type(request.sampling_params).__name__}")
    if not isinstance(request.ignore_eos, bool):
        raise ValueError(f"request {rid!r}: ignore_eos must be True or False, got {request.ignore_eos!r}")
    if not isinstance(request.priority, numbers.Integral) or isinstance(request.priority, bool):
        raise ValueError(f"request {rid!r}: priority must be an int (smaller = more urgent), got {request.priority!r}")
    prompt = request.prompt
    if isinstance(prompt, (bytes, bytearray, dict, set, frozenset)):  # bytes are not ids; a set has no order
        raise ValueError(f"request {rid!r}: prompt must be a str or a list of token ids, "
                         f"not {type(prompt).__name__}")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"request {rid!r}: a text prompt needs a tokenizer; pass one to the engine "
                             "or give the prompt as a list of token ids")
        if not callable(tokenizer):
            raise ValueError(f"request {rid!r}: a text prompt needs a tokenizer that can be called on text "
                             f"(a transformers tokenizer); the engine's is a {type(tokenizer).__name__}")
        ids = list(tokenizer(prompt)["input_ids"])
    else:
        try:
            ids = list(prompt.tolist() if hasattr(prompt, "tolist") else prompt)
        except TypeError:
            raise ValueError(f"request {rid!r}: prompt must be a str or a list of token ids, "
                             f"got {type(prompt).__name__}") from None
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"request {rid!r}: prompt token ids must be ints")
        ids = [int(t) for t in ids]  # numpy or torch integers become plain ints
    if not ids:
        raise ValueError(f"request {rid!r}: the prompt is empty; give at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"request {rid!r}: token id {bad[0]} is outside the vocabulary; "
                         f"ids must be in [0, {vocab_size})")
    stops = [t for t in request.sampling_params.stop_token_ids if not 0 <= t < vocab_size]
    if stops:
        raise ValueError(f"request {rid!r}: stop token id {stops[0]} is outside the vocabulary and could never be "
                         f"sampled; ids must be in [0, {vocab_size})")
    mnt = request.max_new_tokens
    if not isinstance(mnt, numbers.Integral) or isinstance(mnt, bool) or mnt < 1:
        raise ValueError(f"request {rid!r}: max_new_tokens must be an integer >= 1, got {mnt!r}")
    if max_pos is not None and len(ids) + mnt > max_pos:
        raise ValueError(f"request {rid!r}: prompt ({len(ids)} tokens) + max_new_tokens ({mnt}) = "
                         f"{len(ids) + mnt} exceeds the model's {max_pos} positions")
    return ids
