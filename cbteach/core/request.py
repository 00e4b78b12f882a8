"""Requests in, completions out; in between, a :class:`Sequence`: the request's live state in the engine."""
from __future__ import annotations

import enum
import itertools
from dataclasses import KW_ONLY, dataclass, field
from typing import Sequence as Seq

from .sampling import GREEDY, SamplingParams

_auto_ids = itertools.count()


@dataclass
class Request:
    """One generation request: a prompt (a string, or token ids) and at most ``max_new_tokens`` to generate.
    ``ignore_eos`` (for benchmarks) generates past EOS; ``arrival_time`` is seconds after the engine
    started; an id is made up if none is given. The engine checks a request when it is added."""

    prompt: str | Seq[int]
    max_new_tokens: int
    _: KW_ONLY
    request_id: object = None
    arrival_time: float | None = None
    priority: int = 0  # smaller = more urgent, read by policy='priority' (fcfs orders by arrival: one workload runs under both)
    ignore_eos: bool = False
    sampling_params: SamplingParams = GREEDY

    def __post_init__(self):
        if self.request_id is None:
            self.request_id = f"req-{next(_auto_ids)}"


@dataclass
class Completion:
    """The result of one request (``output_ids`` ends with the EOS id when ``finish_reason == "eos"``).
    Times are seconds on the engine's clock: ``first_token_time - arrival_time`` is the TTFT."""

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
        text, failed = decode_text(tokenizer, seq.output_ids)
        return cls(request_id=seq.request_id, prompt_ids=list(seq.prompt_ids), output_ids=list(seq.output_ids),
                   finish_reason="error" if failed else seq.finish_reason, text=text, arrival_time=seq.arrival_time,
                   first_token_time=seq.first_token_time, token_times=list(seq.token_times), finish_time=now,
                   num_cached_prompt_tokens=seq.num_cached_prompt_tokens, error=failed or seq.error)

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


def decode_text(tokenizer, ids) -> tuple[str | None, str | None]:
    """``(text, None)``, or ``(None, why)`` when the tokenizer cannot decode ``ids`` (sentencepiece raises on
    an id past its vocabulary, which a model may pad): the tokens stand, this request alone fails."""
    try:
        return (None if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=True)), None
    except Exception as err:  # noqa: BLE001
        return None, f"the tokenizer could not decode this request's tokens: {type(err).__name__}: {err}"


class RequestStatus(enum.Enum):
    """Where a request is in its life; only the scheduler moves it on."""

    WAITING = "waiting"  # queued, never run (or not arrived yet)
    RUNNING = "running"  # in the batch: it has a slot and KV blocks
    PREEMPTED = "preempted"  # taken out of the batch to free KV room; queued again, to be recomputed
    FINISHED = "finished"  # stopped at EOS or max_new_tokens
    ABORTED = "aborted"  # cancelled by Engine.abort

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.ABORTED)


@dataclass(eq=False)
class Sequence:
    """A request's live state. Everything a scheduler decides turns on ``num_computed_tokens``: tokens
    ``[0, num_computed_tokens)`` of ``prompt + output`` have their K/V in the cache, the rest must still
    go through the model."""

    # -- identity: what was asked ----------------------------------------------------------------
    request: Request
    prompt_ids: list[int]
    generator_state: bytes | None = None  # a seeded request's random stream, when moved from another engine
    claimed: bool = False  # added by run() or stream(), which report on it themselves (streams skip it)
    # -- scheduling: where it is, how far it got ---------------------------------------------------
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    slot: int | None = None  # which batch slot (timeline row) it occupies -- not a KV slot of a slot_mapping
    finish_reason: str | None = None  # "eos", "stop", "length", "aborted" or "error" once finished
    error: str | None = None  # finish_reason "error": what went wrong for this request alone
    num_preemptions: int = 0
    num_placeholders: int = 0  # tokens a step in flight will give it, not appended yet (V1's num_output_placeholders)
    # -- KV: its room in the cache (paged) -----------------------------------------------------------
    block_table: list[int] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    ready_time: float = 0.0  # its K/V are usable from this time on (K/V that arrive from elsewhere)
    draft_ids: list[int] = field(default_factory=list)  # guesses to feed next step (V1's spec_token_ids)
    sample_index: int | None = None  # which sample of its request, n > 1 (None: the request has one)
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
        """Batch slots its admission takes."""
        return 1

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens ``start..end-1`` of prompt + output, without building the whole list."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[max(0, start - p) : end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_generated(self) -> int:
        """Output tokens, counting those a step in flight will give it (none when steps run one at a time)."""
        return len(self.output_ids) + self.num_placeholders

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Known tokens plus those a step in flight will give it."""
        return len(self.prompt_ids) + self.num_generated

    @property
    def is_decoding(self) -> bool:
        """Its next step is a decode: everything before its last sampled token is computed. Anything else
        -- a prompt, a chunk of one, a recompute after preemption -- is a prefill."""
        return bool(self.num_generated) and self.num_computed_tokens == len(self.prompt_ids) + self.num_generated - 1

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, prompt={len(self.prompt_ids)}, out={len(self.output_ids)}, "
                f"computed={self.num_computed_tokens})")
