"""The HTTP side: FastAPI routes that turn OpenAI requests into jobs for the engine worker, and back.

Each request is handled by a coroutine on uvicorn's event loop; none of them touches the engine. A
:class:`Run` submits one :class:`~cbteach.serving.server_worker.Job` per choice, waits until the
worker has accepted (or refused) all of them -- so bad input still gets its 4xx before any byte of a
stream is sent -- and then relays the worker's events: as one JSON body, or as server-sent events
ending ``data: [DONE]``. Whatever way a run ends -- finished, the client gone, the stream cancelled
at shutdown -- its ``finally`` aborts the jobs still in flight, so their KV blocks go back to the pool.

FastAPI and uvicorn are imported here and only here (plus :mod:`.server`), so ``import cbteach``
works without the ``serve`` extra. (No ``from __future__ import annotations`` here: FastAPI reads the
routes' ``Request`` annotations at definition time, and ``Request`` is imported inside :func:`create_app`.)
"""
import asyncio
import hmac
import json
import time
import uuid
from contextlib import asynccontextmanager
from functools import partial
from importlib import resources

from . import openai_protocol as proto
from .openai_protocol import APIError
from .server_worker import Job

ACCEPT_POLL_S = 1.0  # how often a waiting handler checks that the worker is still alive
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there
LIVE_PUSH_S = 0.05  # the live view gets at most ~20 updates a second (several steps each)


class Run:
    """One HTTP request's jobs and the events the worker sends back for them."""

    def __init__(self, req: proto.GenerationRequest, worker, loop):
        self.req, self.worker, self.loop = req, worker, loop
        self.id = f"{'chatcmpl' if req.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.queue: asyncio.Queue = asyncio.Queue()
        self.jobs = [Job(prompt, req.max_tokens, sp, partial(self._emit, i), stop=req.stop,
                         ignore_eos=req.ignore_eos, request_id=f"{self.id}-{i}") for i, prompt, sp in req.choices()]
        self.prompt_tokens = [0] * len(self.jobs)
        self.finished = [None] * len(self.jobs)  # (reason, num_output_tokens)
        self.early: list = []  # events that came while other choices were still being accepted

    def _emit(self, index: int, event) -> None:  # worker thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))

    async def _next(self):
        while True:
            try:
                return await asyncio.wait_for(self.queue.get(), ACCEPT_POLL_S)
            except asyncio.TimeoutError:
                if not self.worker.alive:
                    raise APIError(503, "the engine worker has stopped", type="server_error") from None

    async def start(self) -> None:
        """Submit every job and wait for the worker's verdict on each; a refusal aborts the others."""
        for job in self.jobs:
            self.worker.submit(job)
        try:
            await self._accepted()
        except BaseException:  # refused, or the handler was cancelled while waiting: nothing may keep running
            self.abort()
            raise

    async def _accepted(self) -> None:
        pending, errors = set(range(len(self.jobs))), []
        while pending:
            index, event = await self._next()
            if event[0] == "accepted":
                self.prompt_tokens[index] = event[1]
                pending.discard(index)
            elif event[0] == "error":  # the engine's message names our internal id: the client never saw it
                errors.append(event[1].replace(f"request {self.jobs[index].request_id!r}: ", ""))
                self.finished[index] = ("error", 0)
                pending.discard(index)
            else:
                self.early.append((index, event))
        if errors:
            status = 503 if "shutting down" in errors[0] else 400
            raise APIError(status, errors[0], type="invalid_request_error" if status == 400 else "server_error")

    async def events(self):
        """``(choice index, event)`` until every choice has finished."""
        for item in self.early:
            yield item
        self.early = []
        while any(f is None for f in self.finished):
            index, event = await self._next()
            if event[0] == "finish":
                self.finished[index] = (event[1], event[2])
            yield index, event

    def abort(self) -> None:
        for job, done in zip(self.jobs, self.finished):
            if done is None:
                self.worker.abort(job.request_id)

    def usage(self) -> dict:
        return proto.usage(sum(self.prompt_tokens), sum(f[1] for f in self.finished if f is not None))

    async def whole(self, request) -> dict:
        """Collect the answer (aborting it if the client goes away while it waits)."""
        texts, ids = [[] for _ in self.jobs], [[] for _ in self.jobs]
        gen, checked = self.events(), time.monotonic()
        try:
            while True:
                task = asyncio.ensure_future(gen.__anext__())
                while not task.done():
                    await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                    if time.monotonic() - checked >= DISCONNECT_POLL_S:  # tokens may flow faster than the poll
                        checked = time.monotonic()
                        if await request.is_disconnected():
                            task.cancel()
                            raise asyncio.CancelledError("the client disconnected")
                try:
                    index, event = task.result()
                except StopAsyncIteration:
                    break
                if event[0] == "delta":
                    texts[index].append(event[1])
                    ids[index].extend(event[2])
        finally:
            self.abort()
        if any(f[0] == "error" for f in self.finished):
            raise APIError(500, "the engine failed while generating; see the server's log", type="server_error")
        choices = [proto.choice(self.req, i, "".join(t), f[0], d)
                   for i, (t, f, d) in enumerate(zip(texts, self.finished, ids))]
        return proto.response(self.req, self.id, self.created, choices, self.usage())

    async def sse(self):
        """The stream: a role chunk per choice (chat), a chunk per step with tokens, a closing chunk per choice
        with its ``finish_reason``, the usage chunk if asked for, and ``[DONE]``."""
        req, rid, created = self.req, self.id, self.created
        try:
            if req.kind == "chat":
                for i in range(len(self.jobs)):
                    yield _data(proto.chunk(req, rid, created, i, None, role=True))
            async for index, event in self.events():
                if event[0] == "delta":
                    yield _data(proto.chunk(req, rid, created, index, event[1], token_ids=event[2]))
                elif event[0] == "finish":
                    yield _data(proto.chunk(req, rid, created, index, None, event[1]))
            if req.include_usage:
                yield _data(proto.usage_chunk(req, rid, created, self.usage()))
            yield "data: [DONE]\n\n"
        finally:  # the client hung up, or the server is going down: stop generating for nobody
            self.abort()


def _data(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def read_json(request, limit: int):
    """The body as JSON, refusing more than ``limit`` bytes without reading them all."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is larger than this server's limit of {limit} bytes")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise APIError(413, f"the request body is larger than this server's limit of {limit} bytes")
        parts.append(part)
    try:
        return json.loads(b"".join(parts))
    except (ValueError, UnicodeDecodeError) as err:
        raise proto.bad(f"the request body is not valid JSON: {err}") from None


def create_app(worker, limits: proto.Limits, hub, metrics, *, api_key: str | None = None,
               max_body_bytes: int = 1 << 20, max_in_flight: int = 512, max_model_len: int | None = None):
    """The FastAPI application around a started-or-not :class:`~cbteach.serving.server_worker.EngineWorker`."""
    from fastapi import FastAPI, Request
    from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    @asynccontextmanager
    async def lifespan(app):
        hub.bind(asyncio.get_running_loop())
        if not worker.alive:
            worker.start()
        yield
        hub.close()
        await asyncio.get_running_loop().run_in_executor(None, worker.stop)

    app = FastAPI(title="cbteach", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    tokenizer = worker.tokenizer

    @app.exception_handler(APIError)
    async def api_error(request, err: APIError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, err: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        return JSONResponse(APIError(err.status_code, f"{err.detail}: {request.method} {request.url.path}",
                                     code=code).body(), status_code=err.status_code)

    def authorize(request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    async def generate(request, parse):
        authorize(request)
        req = parse(await read_json(request, max_body_bytes))
        if worker.num_in_flight + req.n * len(req.prompts) > max_in_flight:
            raise APIError(503, f"the server has {max_in_flight} requests in flight, its limit; retry later",
                           type="server_error", code="server_overloaded")
        run = Run(req, worker, asyncio.get_running_loop())
        await run.start()
        if req.stream:
            return StreamingResponse(run.sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(await run.whole(request))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, lambda body: proto.parse_completion(body, limits))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, lambda body: proto.parse_chat(body, limits, tokenizer))

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": limits.served_model, "object": "model", "created": 0,
                                            "owned_by": "cbteach", "max_model_len": max_model_len}]}

    @app.get("/health")
    async def health():
        if not worker.alive:
            raise APIError(503, "the engine worker has stopped", type="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/")
    async def live_page():
        return HTMLResponse(resources.files("cbteach.serving").joinpath("static/live.html").read_text())

    @app.get("/live/steps")
    async def live_steps(since: int = -1):
        return {"max_batch_size": hub.max_batch_size, "steps": hub.steps(since)}

    @app.get("/live/events")
    async def live_events():
        return StreamingResponse(_live_stream(hub), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


async def _live_stream(hub):
    """The live view's stream: the recent history first, then batches of new steps; ends at shutdown."""
    q = hub.subscribe()
    try:
        yield "retry: 1000\n\n"
        yield _data({"max_batch_size": hub.max_batch_size, "steps": hub.steps()[-200:]})
        while not hub.closed:
            try:
                first = await asyncio.wait_for(q.get(), 15)
            except asyncio.TimeoutError:
                yield ": keep-alive\n\n"
                continue
            batch = [first]
            while not q.empty():
                batch.append(q.get_nowait())
            if None in batch:
                return
            yield _data({"max_batch_size": hub.max_batch_size, "steps": batch})
            await asyncio.sleep(LIVE_PUSH_S)
    finally:
        hub.unsubscribe(q)
