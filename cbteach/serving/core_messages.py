"""The messages between the API server and its engine cores, and their wire encoding.

vLLM V1 splits a server in two processes: the **API server** (HTTP, validation, tokenization,
detokenization) and the **engine core** (a busy loop of schedule, execute, update). They talk over
ZeroMQ sockets in msgpack, through a handful of small typed messages -- ``EngineCoreRequest`` in,
``EngineCoreOutputs`` out (``vllm/v1/engine/__init__.py``). These are cbteach's, defined with
``msgspec`` (typed structs encoded to msgpack and decoded back, checked on the way in):

API server -> engine core (:data:`CoreInput`)
    :class:`AddRequest` -- one request as token ids, never text (the API server tokenized it);
    :class:`Abort` -- ids to drop at once (a client hung up, a stop string was seen);
    :class:`Shutdown` -- stop the loop and exit.

engine core -> API server (:data:`CoreOutput`)
    :class:`Ready` -- the model is loaded and the engine built: what the API server must know to
    validate requests (positions, vocabulary, pool);
    :class:`StepOutputs` -- **one message per engine step**, with every sequence's new token ids
    (not text), the requests that finished, the ones accepted or refused since the last message,
    and the core's counters (for routing, ``/metrics`` and the live view);
    :class:`Dead` -- the engine failed as a whole (a broken rule, a bug): the core exits after it.

Structs are ``array_like``: a message is a msgpack array of its fields, not a map of names, which
keeps a 16-sequence step's message in the hundreds of bytes.
"""
from __future__ import annotations

from typing import Union

import msgspec


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    fail_after: int | None = None  # fault injection (tests): fail this request after so many tokens
    stop_token_ids: tuple[int, ...] = ()  # more ids that end the request (SamplingParams.stop_token_ids)
    priority: int = 0  # Request.priority (smaller = more urgent; read by policy="priority")


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


CoreInput = Union[AddRequest, Abort, Shutdown]


class SeqOutput(msgspec.Struct, array_like=True):
    """One scheduled sequence's part of a step (a prefill chunk that stops short has no token)."""

    request_id: str
    new_token_ids: list[int]
    slot: int = -1  # its batch slot (the live view's row)
    kind: str = ""  # "prefill" or "decode"
    num_scheduled_tokens: int = 0


class Finished(msgspec.Struct, array_like=True):
    request_id: str
    finish_reason: str  # the engine's: "eos", "stop", "length" or "error"
    error: str | None = None  # finish_reason "error": what went wrong for this request alone


class CoreStats(msgspec.Struct, array_like=True):
    """The core's state after the step, and its running totals."""

    num_running: int = 0
    num_waiting: int = 0  # queued, preempted or swapped out
    kv_used: int = 0  # KV blocks in use (0 for the concatenating cache)
    kv_total: int = 0
    num_steps: int = 0  # engine steps run so far
    num_messages_out: int = 0  # messages sent so far, this one included
    bytes_out: int = 0  # their encoded bytes, before this one
    num_messages_in: int = 0
    bytes_in: int = 0
    num_preemptions: int = 0
    step_s: float = 0.0  # seconds inside engine.step()
    idle_s: float = 0.0  # seconds waiting for a request with nothing to do
    io_s: float = 0.0  # seconds decoding inputs and encoding and sending outputs


class StepOutputs(msgspec.Struct, tag="step", array_like=True):
    core: int
    step: int  # the engine's step number; -1 for a message that carries no step (an abort's new counts)
    t: float  # seconds on the core's clock (since it started)
    outputs: list[SeqOutput] = []
    finished: list[Finished] = []
    accepted: list[str] = []
    rejected: list[tuple[str, str]] = []  # (request_id, why): the engine's own validation refused it
    admitted: list[str] = []
    preempted: list[str] = []
    duration: float = 0.0  # seconds this step took inside engine.step()
    stats: CoreStats = msgspec.field(default_factory=CoreStats)


class Ready(msgspec.Struct, tag="ready", array_like=True):
    core: int
    pid: int
    max_positions: int
    vocab_size: int
    max_batch_size: int
    kv_kind: str
    num_blocks: int = 0
    block_size: int = 0
    default_temperature: float = 0.0


class Dead(msgspec.Struct, tag="dead", array_like=True):
    core: int
    message: str


CoreOutput = Union[StepOutputs, Ready, Dead]

# One encoder for both directions; a decoder per direction checks what it reads against the types.
encoder = msgspec.msgpack.Encoder()
input_decoder = msgspec.msgpack.Decoder(CoreInput)
output_decoder = msgspec.msgpack.Decoder(CoreOutput)
