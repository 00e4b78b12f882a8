"""The server's routes, and who may call them.

``POST /v1/completions`` and ``/v1/chat/completions`` (streamed or not), ``GET /v1/models``,
``GET /health`` (503 once an engine core has died), ``GET /metrics`` (Prometheus), and the live
view: ``GET /`` (the page), ``/live/steps`` and ``/live/events``.

With an API key set, every route but ``/health`` takes it: ``Authorization: Bearer KEY`` (what
OpenAI clients and Prometheus send). A browser cannot put a header on the live view's event
stream, so the page is opened once as ``/?key=KEY``: the server answers with the page and a cookie
(HttpOnly, SameSite=Strict) that the page's own requests then carry. Keys are compared in constant
time. (No ``from __future__ import annotations``: FastAPI reads the annotations.)
"""
import asyncio
import hmac
import json
import re
import time
from importlib import resources

from . import openai_protocol as proto
from .openai_protocol import APIError

COOKIE = "cbteach_key"
LIVE_PUSH_S = 0.05  # the live view gets at most ~20 updates a second (several steps each)
FAULT_FIELD = "cbteach_fail_after"  # serve --fault-injection: fail this request after so many tokens (tests)


def add_routes(app, fe, Run, read_json) -> None:
    from fastapi import Request
    from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(APIError)
    async def api_error(request, err: APIError):
        headers = None if err.retry_after is None else {"Retry-After": str(err.retry_after)}
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, err: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        return JSONResponse(APIError(err.status_code, f"{err.detail}: {request.method} {request.url.path}",
                                     code=code).body(), status_code=err.status_code)

    def key_ok(token: str) -> bool:
        return hmac.compare_digest(token.strip().encode(), fe.api_key.encode())

    def authorize(request, browser: bool = False) -> None:
        if fe.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and key_ok(token):
            return
        if browser and key_ok(request.cookies.get(COOKIE, "") or request.query_params.get("key", "")):
            return
        raise APIError(401, "a valid API key is required: send the header 'Authorization: Bearer <key>'"
                       + (" (in a browser: open /?key=<key>)" if browser else ""), code="invalid_api_key")

    async def generate(request, parse):
        authorize(request)
        created = time.perf_counter()
        body = await read_json(request, fe.max_body_bytes, fe.body_timeout)
        req = parse(body)
        run = Run(req, fe, created, _fail_after(body, fe.fault_injection))
        await run.start()
        if req.stream:
            return StreamingResponse(run.sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(await run.whole(request))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, lambda body: proto.parse_completion(body, fe.limits))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, lambda body: proto.parse_chat(body, fe.limits, fe.tokenizer))

    def model_card() -> dict:
        return {"id": fe.name, "object": "model", "created": 0, "owned_by": "cbteach", "max_model_len": fe.max_model_len}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        authorize(request)
        if model_id != fe.name:
            raise APIError(404, f"The model {model_id!r} does not exist; this server serves {fe.name!r}",
                           param="model", code="model_not_found")
        return model_card()

    @app.api_route("/health", methods=["GET", "HEAD"])  # load balancers often ask with HEAD
    async def health():
        if not fe.client.alive:
            raise APIError(503, f"unhealthy: {fe.client.dead or 'an engine core has stopped'}", type="server_error",
                           code="engine_dead")
        return {"status": "ok", "engine_cores": fe.client.num_cores}

    @app.get("/metrics")
    async def prometheus(request: Request):
        authorize(request)
        return PlainTextResponse(fe.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/")
    async def live_page(request: Request):
        authorize(request, browser=True)
        page = HTMLResponse(resources.files("cbteach.serving").joinpath("static/live.html").read_text())
        if fe.api_key is not None and request.query_params.get("key"):
            page.set_cookie(COOKIE, request.query_params["key"], httponly=True, samesite="strict")
        return page

    @app.get("/live/steps")
    async def live_steps(request: Request):
        authorize(request, browser=True)  # (the query is read after the key: a stranger learns nothing of it)
        since = request.query_params.get("since", "-1")
        if not re.fullmatch(r"-?[0-9]{1,18}", since):
            raise proto.bad(f"'since' must be a step number (an integer), got {since[:40]!r}", "since")
        since = int(since)
        return {"max_batch_size": fe.hub.max_batch_size, "num_cores": fe.hub.num_cores, "steps": fe.hub.steps(since)}

    @app.get("/live/events")
    async def live_events(request: Request):
        authorize(request, browser=True)
        q = fe.hub.subscribe()
        if q is None:
            raise APIError(503, f"the live view already has {fe.hub.max_listeners} listeners, its limit "
                           "(--max-live-listeners)", type="server_error", code="too_many_listeners")
        return StreamingResponse(_live_stream(fe.hub, q), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _fail_after(body: dict, enabled: bool):
    """The fault-injection field of a request body: only a server started with ``--fault-injection`` takes it."""
    if not isinstance(body, dict) or FAULT_FIELD not in body:
        return None
    value = body[FAULT_FIELD]
    if not enabled:
        raise proto.bad(f"'{FAULT_FIELD}' is for tests: start the server with --fault-injection", FAULT_FIELD)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**31:
        raise proto.bad(f"'{FAULT_FIELD}' must be an integer from 0 to 2**31 - 1", FAULT_FIELD)
    return value


def _data(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _live_stream(hub, q):
    """The live view's stream: the recent history first, then batches of new steps; ends at shutdown."""
    try:
        yield "retry: 1000\n\n"
        yield _data({"max_batch_size": hub.max_batch_size, "num_cores": hub.num_cores, "steps": hub.steps()[-200:]})
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
            yield _data({"max_batch_size": hub.max_batch_size, "num_cores": hub.num_cores, "steps": batch})
            await asyncio.sleep(LIVE_PUSH_S)
    finally:
        hub.unsubscribe(q)
