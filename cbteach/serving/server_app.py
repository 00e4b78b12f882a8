"""The HTTP side: FastAPI routes that turn OpenAI requests into requests for the engine cores, and back.

Each request is handled by a coroutine on uvicorn's event loop. A :class:`Run` checks and tokenizes
its prompts (:mod:`.tokenization`), routes one request per choice to an engine core
(:class:`~.frontend.Frontend`), waits until each core has accepted (or refused) its share -- so bad
input still gets its 4xx before any byte of a stream is sent -- and then relays the events the
output processor puts on its queue: as one JSON body, or as server-sent events ending
``data: [DONE]``. A stream that fell behind finds several events waiting and writes them in one
send. Whatever way a run ends -- finished, the client gone, the server stopping -- its ``finally``
aborts what is still in flight, so the KV blocks go back to the pool at once.

An answer that cannot be finished is an error, never a ``200`` that pretends: a request that failed
inside the engine gets a ``500`` (``server_error``) saying why, one cut short by shutdown or by a
dead engine core a ``503``; a stream already under way ends with an error event
(``data: {"error": {...}}``, as vLLM sends) and ``[DONE]``. Its neighbours are not touched.

FastAPI and uvicorn are imported here and in :mod:`.server` and :mod:`.server_http` only, so
``import cbteach`` works without the ``serve`` extra. (No ``from __future__ import annotations``
here: FastAPI reads the routes' ``Request`` annotations at definition time.)
"""
import asyncio
import json
import time
import uuid

import msgspec

from . import openai_protocol as proto
from .openai_protocol import APIError
from .server_routes import add_routes

FAILED = {"error": (500, "server_error", "this request failed inside the engine"),
          "dead": (503, "server_error", "the engine core serving this request died"),
          "abort": (503, "server_error", "the server stopped before this answer was complete")}


class Run:
    """One HTTP request's choices and the events that come back for them."""

    def __init__(self, req: proto.GenerationRequest, fe, created: float, fail_after=None):
        self.req, self.fe, self.created, self.fail_after = req, fe, created, fail_after
        self.id = f"{'chatcmpl' if req.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.unix_time = int(time.time())
        self.queue: asyncio.Queue = asyncio.Queue()
        self.states: list = []
        self.prompt_tokens: list = []
        self.finished: list = []  # per choice: (reason, num_output_tokens, error) once it ends

    async def start(self) -> None:
        """Tokenize, route every choice, and wait for the cores' verdicts; a refusal aborts the others."""
        choices = list(self.req.choices())
        self.fe.check_open(len(choices))
        ids = [await self.fe.checker.to_ids(p, self.req.max_tokens) for p in self.req.prompts]
        self.fe.check_open(len(choices))  # (tokenizing took time)
        per_prompt = len(choices) // len(self.req.prompts)
        for i, _, sp in choices:
            self.states.append(self.fe.submit(self.req, i, ids[i // per_prompt], sp, self.queue, self.created,
                                              self.fail_after, http_id=self.id))
        self.prompt_tokens = [len(x) for x in ids]  # each prompt once, whatever n (OpenAI's and vLLM's usage)
        self.finished = [None] * len(self.states)
        try:
            await self._accepted()
        except BaseException:  # refused, or the handler was cancelled while waiting: nothing may keep running
            self.abort()
            raise

    async def _accepted(self) -> None:
        pending, errors, self.early = set(range(len(self.states))), [], []
        while pending:
            index, event = await self.queue.get()
            if event[0] == "accepted":
                pending.discard(index)
            elif event[0] == "rejected":
                named = f"request {self.states[index].request_id!r}"  # an id the client never saw
                which = "this request" if len(self.req.prompts) == 1 else \
                    f"prompt {index // (len(self.states) // len(self.req.prompts))} of this request"
                errors.append(event[1].replace(named + ": ", "").replace(named, which))
                self.finished[index] = ("error", 0, event[1])
                pending.discard(index)
            else:
                if event[0] == "finish":
                    self.finished[index] = event[1:]
                    pending.discard(index)
                self.early.append((index, event))
        if errors:
            raise APIError(400, errors[0], param="messages" if self.req.kind == "chat" else "prompt")  # (what the
            # cores refuse: a prompt and its max_tokens)
        failure = next((f for f in self.finished if f is not None and f[0] in FAILED), None)
        if failure is not None:
            raise _failure(failure)

    async def events(self):
        """``(choice index, [events])`` batches until every choice has finished (or one failed)."""
        early, self.early = self.early, []
        for item in early:
            yield [item]
        while any(f is None for f in self.finished):
            batch = [await self.queue.get()]
            while not self.queue.empty():
                batch.append(self.queue.get_nowait())
            for index, event in batch:
                if event[0] == "finish":
                    self.finished[index] = event[1:]
            yield batch
            if any(f is not None and f[0] in FAILED for f in self.finished):
                return

    def abort(self) -> None:
        for st in self.states:
            self.fe.client.abort(st)

    def usage(self) -> dict:
        return proto.usage(sum(self.prompt_tokens), sum(f[1] for f in self.finished if f is not None))

    async def whole(self, request) -> dict:
        """Collect the answer; a client that hangs up meanwhile aborts it at once."""
        texts, ids = [[] for _ in self.states], [[] for _ in self.states]
        watcher = asyncio.ensure_future(_disconnected(request))
        watcher.add_done_callback(lambda t: t.cancelled() or self.abort())
        try:
            async for batch in self.events():
                for index, event in batch:
                    if event[0] == "delta":
                        texts[index].append(event[1])
                        ids[index].extend(event[2])
        finally:
            watcher.cancel()
            self.abort()
        failure = next((f for f in self.finished if f is not None and f[0] in FAILED), None)
        if failure is not None:
            raise _failure(failure)
        choices = [proto.choice(self.req, i, "".join(t), f[0], d)
                   for i, (t, f, d) in enumerate(zip(texts, self.finished, ids))]
        return proto.response(self.req, self.id, self.unix_time, choices, self.usage())

    async def sse(self):
        """The stream: a role chunk per choice (chat), a chunk per step with tokens, a closing chunk per choice
        with its ``finish_reason``, the usage chunk if asked for, and ``[DONE]``; or an error event."""
        req, rid, t = self.req, self.id, self.unix_time
        try:
            if req.kind == "chat":
                yield b"".join(_data(proto.chunk(req, rid, t, i, None, role=True)) for i in range(len(self.states)))
            async for batch in self.events():
                parts = []
                for index, event in batch:
                    if event[0] == "delta" and (event[1] or event[2]):
                        parts.append(_data(proto.chunk(req, rid, t, index, event[1], token_ids=event[2])))
                    elif event[0] == "finish" and event[1] in FAILED:
                        parts.append(_data(_failure(event[1:]).body()))
                    elif event[0] == "finish":
                        parts.append(_data(proto.chunk(req, rid, t, index, None, event[1])))
                if parts:
                    yield b"".join(parts)  # every event that was waiting, in one write
            if req.include_usage and not any(f is None or f[0] in FAILED for f in self.finished):
                yield _data(proto.usage_chunk(req, rid, t, self.usage()))
            yield b"data: [DONE]\n\n"
        finally:  # the client hung up, or the server is going down: stop generating for nobody
            self.abort()


def _failure(finished) -> APIError:
    reason, _, error = finished
    status, kind, what = FAILED[reason]
    return APIError(status, f"{what}: {error}" if error else what, type=kind,
                    code={"error": "engine_error", "dead": "engine_dead", "abort": "aborted"}[reason])


_json = msgspec.json.Encoder()


def _data(obj) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


async def _disconnected(request) -> None:
    """Returns when the client hangs up (the body has been read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def read_json(request, limit: int, timeout: float):
    """The body as JSON, refusing more than ``limit`` bytes without reading them all, or a body that takes longer
    than ``timeout`` seconds to arrive; a document nested too deeply for the parser is a 400 too."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is larger than this server's limit of {limit} bytes")
    parts, size = [], 0

    async def read():
        nonlocal size
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise APIError(413, f"the request body is larger than this server's limit of {limit} bytes")
            parts.append(part)
    from starlette.requests import ClientDisconnect

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", code="timeout") from None
    except ClientDisconnect:  # nobody is left to read the answer; say so in the log's one line, not a traceback
        raise APIError(400, "the client closed the connection before its request body arrived",
                       code="client_disconnected") from None
    try:
        body = json.loads(b"".join(parts))
        proto.check_text(body)
    except RecursionError:
        raise proto.bad("the request body is nested too deeply to read") from None
    except (ValueError, UnicodeDecodeError) as err:
        if "int_max_str_digits" in str(err):  # Python's guard against quadratic int parsing, not JSON's rule
            raise proto.bad("the request body holds an integer with more than 4,300 digits") from None
        raise proto.bad(f"the request body is not valid JSON: {err}") from None
    return body


def create_app(fe, on_startup=None, on_shutdown=None):
    """The FastAPI application around a started :class:`~.frontend.Frontend`."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI

    @asynccontextmanager
    async def lifespan(app):
        await fe.client.attach()
        fe.stats.start()
        if on_startup is not None:
            on_startup()
        yield
        fe.stats.stop()
        fe.hub.close()
        fe.log.drain_ended()
        await fe.client.shutdown()
        fe.close()
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="cbteach", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    add_routes(app, fe, Run, read_json)
    return app
