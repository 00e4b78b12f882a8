"""``python -m cbteach serve`` over real HTTP on 127.0.0.1: exact answers, bad input, disconnects, isolation, metrics.

The HTTP side runs in a thread of this process, its engine core in a process of its own (as a user
gets it). Every answer is compared with transformers' own ``model.generate`` on one prompt at a time
(greedy, bierce). Clients are the official ``openai`` package (async, many streams at once) and
httpx. Every wait is bounded; nothing is timed.
"""
import asyncio
import json
import socket
import sys
import time

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'cbteach[serve]')")
pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install 'cbteach[serve]')")
pytest.importorskip("zmq", reason="the serve extra is not installed (pip install 'cbteach[serve]')")
pytest.importorskip("msgspec", reason="the serve extra is not installed (pip install 'cbteach[serve]')")

from serverkit import LAB, WAIT_S, core_sum, failure, make_ref, success, wait_for  # noqa: E402
from serverkit import metrics as scrape  # noqa: E402
from serverkit import wait_idle as idle  # noqa: E402

from cbteach.bierce.corpus import headword_prompts  # noqa: E402
from cbteach.serving import server as srv  # noqa: E402

NUM_BLOCKS = 300  # 4,800 tokens: room for a 4,000-token answer that is still running when its client leaves
LONG = 4000


@pytest.fixture(scope="module")
def server():
    s = srv.ServerThread(["--port", "0", "--num-blocks", str(NUM_BLOCKS), "--max-batch-size", "8",
                          "--fault-injection"]).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def ref(bierce):
    return make_ref(*bierce)


def text_of(ref, ids):
    return ref.text(ids)


def metrics(server) -> dict:
    return scrape(server.url)


def wait_idle(server) -> dict:
    return idle(server.url)


def reason_count(m, reason) -> float:
    return success(m, reason) if reason in ("stop", "length") else failure(m, reason)


def client(server, **kw):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0,
                              timeout=WAIT_S, **kw)


# -- exactness -------------------------------------------------------------------------------------
def test_one_request_is_generate_exactly(server, ref):
    r = httpx.post(server.url + "/v1/completions", timeout=WAIT_S,
                   json={"model": "bierce", "prompt": "CYNIC, n.", "max_tokens": 24, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    want = ref("CYNIC, n.", 24)
    assert body["choices"][0]["token_ids"] == want
    assert body["choices"][0]["text"] == text_of(ref, want)
    assert body["usage"]["completion_tokens"] == len(want) and body["usage"]["prompt_tokens"] == 7
    assert body["choices"][0]["finish_reason"] == ("stop" if want[-1] == 0 else "length")


def test_fifty_concurrent_chat_streams_are_exact(server, ref):
    """Fifty clients at once through the official client: each streamed answer is its own generate's."""
    prompts = headword_prompts(50)
    lengths = [8 + 7 * (i % 5) for i in range(50)]

    async def one(c, prompt, n):
        stream = await c.chat.completions.create(model="bierce", messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=n, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"return_token_ids": True})
        text, ids, reason, usage = [], [], None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                text.append(ch.delta.content or "")
                ids.extend(getattr(ch, "token_ids", None) or [])
                reason = ch.finish_reason or reason
        return "".join(text), ids, reason, usage

    async def all_of_them():
        c = client(server)
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(c, p, n) for p, n in zip(prompts, lengths))), 120)
        finally:
            await c.close()

    results = asyncio.run(all_of_them())
    for prompt, n, (text, ids, reason, usage) in zip(prompts, lengths, results):
        want = ref(prompt, n)  # the plain-text template of one user message is the message itself
        assert ids == want, prompt
        assert text == text_of(ref, want)
        assert reason in ("stop", "length") and usage.completion_tokens == len(want)
    wait_idle(server)


def test_prompt_as_token_ids_batched_prompts_and_n(server, ref):
    ids = ref.tok("BORE, n.")["input_ids"]
    r = httpx.post(server.url + "/v1/completions", timeout=WAIT_S,
                   json={"prompt": [ids, "ALONE, adj."], "max_tokens": 12, "n": 2, "return_token_ids": True}).json()
    got = [c["token_ids"] for c in sorted(r["choices"], key=lambda c: c["index"])]
    assert got == [ref(ids, 12)] * 2 + [ref("ALONE, adj.", 12)] * 2


def test_usage_counts_each_prompt_once_whatever_n(server, ref):
    """OpenAI's (and vLLM's) usage: ``prompt_tokens`` is the prompts' tokens, once each, not once per choice."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    one = len(ref.tok("CYNIC, n.")["input_ids"])
    r = client.completions.create(model="bierce", prompt="CYNIC, n.", max_tokens=3, n=3)
    assert r.usage.prompt_tokens == one and r.usage.completion_tokens == sum(len(ref("CYNIC, n.", 3)) for _ in r.choices)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    two = client.completions.create(model="bierce", prompt=["CYNIC, n.", "BORE, n."], max_tokens=2, n=2)
    assert two.usage.prompt_tokens == one + len(ref.tok("BORE, n.")["input_ids"])
    chunks = list(client.completions.create(model="bierce", prompt="CYNIC, n.", max_tokens=3, n=2, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens == one and not chunks[-1].choices
    raw = httpx.post(server.url + "/v1/completions", timeout=WAIT_S, json={
        "prompt": "CYNIC, n.", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}).text
    events = [json.loads(x[6:]) for x in raw.splitlines() if x.startswith("data: {")]
    assert all("usage" in e for e in events) and all(e["usage"] is None for e in events[:-1])  # null until the last
    wait_idle(server)


def test_the_model_can_be_retrieved_and_health_answers_head(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    assert client.models.retrieve("bierce").id == "bierce"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert httpx.head(server.url + "/health", timeout=WAIT_S).status_code == 200


def test_stop_string_cuts_the_answer_and_frees_the_request(server, ref):
    want = text_of(ref, ref("CYNIC, n.", 40))
    stop = want.strip()[4:8]  # a piece from inside the greedy answer
    for stream in (False, True):
        body = {"prompt": "CYNIC, n.", "max_tokens": 40, "stop": [stop], "stream": stream}
        if stream:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=WAIT_S) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            text = "".join(e["choices"][0]["text"] for e in events)
            reason = events[-1]["choices"][0]["finish_reason"]
        else:
            c = httpx.post(server.url + "/v1/completions", json=body, timeout=WAIT_S).json()["choices"][0]
            text, reason = c["text"], c["finish_reason"]
        assert text == want[:want.index(stop)] and reason == "stop"
    wait_idle(server)


def test_load_two_hundred_poisson_requests_from_fifty_clients_none_lost(server, ref):
    """200 requests, Poisson arrivals (40/s), at most 50 in flight: every one answered, exactly."""
    n = 200
    arrivals = np.cumsum(np.random.default_rng(0).exponential(1 / 40, n))
    prompts = headword_prompts(40) * (n // 40)  # 40 distinct prompts, each sent five times, at different moments

    async def go():
        gate = asyncio.Semaphore(50)
        async with httpx.AsyncClient(base_url=server.url, timeout=WAIT_S) as c:
            t0 = time.monotonic()

            async def one(i):
                await asyncio.sleep(max(0.0, arrivals[i] - (time.monotonic() - t0)))
                async with gate:
                    r = await c.post("/v1/completions", json={"prompt": prompts[i], "max_tokens": 6 + i % 40 % 7,
                                                              "return_token_ids": True})
                return r.status_code, r.json()
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), 180)

    before = metrics(server)
    results = asyncio.run(go())
    assert [s for s, _ in results] == [200] * n
    for i, (_, body) in enumerate(results):
        assert body["choices"][0]["token_ids"] == ref(prompts[i], 6 + i % 40 % 7), i
    after = wait_idle(server)
    done = sum(reason_count(after, r) - reason_count(before, r) for r in ("stop", "length"))
    assert done == n and reason_count(after, "abort") == reason_count(before, "abort")


def test_stop_token_ids_end_the_answer_as_in_vllm(server, ref):
    """A token of ``stop_token_ids`` ends the answer (finish_reason "stop"): its id is in ``token_ids`` and in
    ``usage``, its text is not (vLLM's ``include_stop_str_in_output=False``) -- streamed or not. Fields that
    change nothing (``top_k: -1``, ``user``) are taken."""
    want = ref("CYNIC, n.", 24)
    k = next(i for i in range(3, len(want)) if want[i] not in want[:i])  # the first time this id appears
    body = {"prompt": "CYNIC, n.", "max_tokens": 24, "return_token_ids": True, "stop_token_ids": [want[k]],
            "top_k": -1, "user": "u1"}
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=WAIT_S)
    assert whole.status_code == 200, whole.text
    got = whole.json()["choices"][0]
    assert got["token_ids"] == want[:k + 1] and got["finish_reason"] == "stop"
    assert got["text"] == text_of(ref, want[:k]) and whole.json()["usage"]["completion_tokens"] == k + 1
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=WAIT_S) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    choices = [c for e in events for c in e["choices"]]
    assert [t for c in choices for t in c.get("token_ids", [])] == want[:k + 1]
    assert "".join(c["text"] for c in choices) == text_of(ref, want[:k])
    assert choices[-1]["finish_reason"] == "stop"
    wait_idle(server)


# -- bad input ---------------------------------------------------------------------------------------
BAD = [
    (b"{not json", 400, None), (b"[1, 2]", 400, None), (b"[" * 100_000 + b"]" * 100_000, 400, None),
    ({"model": "gpt-4", "prompt": "x", "max_tokens": 4}, 404, "model"),
    ({"prompt": "x"}, 400, "max_tokens"), ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"), ({"prompt": "x", "max_tokens": 10 ** 6}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": "10"}, 400, "max_tokens"), ({"prompt": "x", "max_tokens": 4.5}, 400, "max_tokens"),
    ({"prompt": 5, "max_tokens": 4}, 400, "prompt"), ({"prompt": "", "max_tokens": 4}, 400, "prompt"),
    ({"prompt": [], "max_tokens": 4}, 400, "prompt"), ({"prompt": [1, "a"], "max_tokens": 4}, 400, "prompt"),
    ({"prompt": [1, -3], "max_tokens": 4}, 400, "prompt"), ({"prompt": [99999], "max_tokens": 4}, 400, "prompt"),
    ({"prompt": "x", "max_tokens": 4, "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "max_tokens": 4, "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "max_tokens": 4, "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "max_tokens": 4, "n": 0}, 400, "n"), ({"prompt": "x", "max_tokens": 4, "n": 99}, 400, "n"),
    ({"prompt": "x", "max_tokens": 4, "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "max_tokens": 4, "stop": 5}, 400, "stop"),
    ({"prompt": "x", "max_tokens": 4, "seed": -2}, 400, "seed"),
    ({"prompt": "x", "max_tokens": 4, "logprobs": 3}, 400, "logprobs"),
    ({"prompt": "x", "max_tokens": 4, "cbteach_fail_after": -1}, 400, "cbteach_fail_after"),
    ({"prompt": [7] * 4090, "max_tokens": 10}, 400, "prompt"),  # longer than the model's 4,096 positions
    ({"prompt": "q. " * 3000, "max_tokens": 10}, 400, "prompt"),  # tokenized (in a thread): 9,000 tokens
    ({"prompt": "a" * 900_000, "max_tokens": 4}, 400, "prompt"),  # refused before it is tokenized
    (b'{"prompt": "a\\ud800b", "max_tokens": 4}', 400, "prompt"),  # a lone surrogate: valid JSON, not text
    (b'{"model": "\\ud800", "prompt": "a", "max_tokens": 4}', 400, "model"),
    ({"prompt": "x", "max_tokens": 4, "user": 5}, 400, "user"),
    # what would change the answer and is not implemented is refused, never ignored; so is an unknown field
    ({"prompt": "x", "max_tokens": 4, "top_k": 50}, 400, "top_k"),
    ({"prompt": "x", "max_tokens": 4, "min_tokens": 3}, 400, "min_tokens"),
    ({"prompt": "x", "max_tokens": 4, "best_of": True}, 400, "best_of"),  # JSON's true is not 1
    ({"prompt": "x", "max_token": 4}, 400, "max_token"),  # misspelt: not a default in disguise
    ({"prompt": "x", "max_tokens": 4, "stop_token_ids": "x"}, 400, "stop_token_ids"),
    ({"prompt": "x", "max_tokens": 4, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({"prompt": "x", "max_tokens": 4, "stop_token_ids": [2**64]}, 400, "stop_token_ids"),  # (a 500 once, and a slot lost)
    ({"prompt": "x", "max_tokens": 4, "stop_token_ids": [2048]}, 400, "stop_token_ids"),  # outside bierce's vocabulary
    ({"prompt": "x", "max_tokens": 4, "logprobs": 0}, 400, "logprobs"),  # (0 asks for the chosen token's logprob)
    ({"prompt": "x", "max_tokens": 4, "priority": "high"}, 400, "priority"),
    ({"prompt": "x", "max_tokens": 4, "priority": 2**40}, 400, "priority"),
    ({"prompt": "x", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": "yes"}}, 400,
     "stream_options"),
]
BAD_CHAT = [({"messages": "hi", "max_tokens": 4}, 400, "messages"),
            ({"messages": [], "max_tokens": 4}, 400, "messages"),
            ({"messages": [{"role": "wizard", "content": "x"}], "max_tokens": 4}, 400, "messages"),
            ({"messages": [{"role": "user", "content": 3}], "max_tokens": 4}, 400, "messages"),
            ({"messages": [{"role": "user", "content": "x"}]}, 400, "max_completion_tokens"),
            (b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 4}', 400, "messages"),
            ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 4, "max_tokens": -1}, 400,
             "max_tokens"),
            # two lengths: one was taken and the other ignored
            ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 4, "max_tokens": 5}, 400,
             "max_completion_tokens")]


def _post(server, path, body):
    raw = {"content": body, "headers": {"content-type": "application/json"}}
    kw = raw if isinstance(body, bytes) else {"json": body}
    return httpx.post(server.url + path, timeout=WAIT_S, **kw)


def test_bad_input_gets_an_openai_error_and_disturbs_nobody(server, ref):
    """While one long answer streams, every kind of bad input is refused with a JSON error body; the stream stays
    exact. JSON nested 100,000 deep is a 400, not a crash; a 900 KB prompt is refused without being tokenized."""
    body = {"prompt": "EXECUTIVE, n.", "max_tokens": 200, "stream": True, "return_token_ids": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=WAIT_S) as live:
        lines = live.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))  # it is running now
        cases = [("/v1/completions", b, s, p) for b, s, p in BAD] + [("/v1/chat/completions", b, s, p)
                                                                    for b, s, p in BAD_CHAT]
        for path, bad, status, param in cases:
            r = _post(server, path, bad)
            assert r.status_code == status, (bad[:40] if isinstance(bad, bytes) else str(bad)[:80], r.text[:300])
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
            assert err["param"] == param, (str(bad)[:80], err)
        rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    ids = [t for e in [json.loads(first[6:])] + rest for t in e["choices"][0].get("token_ids", [])]
    assert ids == ref("EXECUTIVE, n.", 200)
    tokenized = server.frontend.checker.num_tokenized
    huge = _post(server, "/v1/completions", {"prompt": "a" * 900_000, "max_tokens": 4}).json()["error"]
    assert "4096 positions" in huge["message"] and huge["code"] == "context_length_exceeded"
    assert server.frontend.checker.num_tokenized == tokenized  # refused by its length alone
    assert _post(server, "/v1/completions", {"prompt": "q. " * 3000, "max_tokens": 4}).status_code == 400
    assert server.frontend.checker.num_tokenized == tokenized + 1  # this one could have fitted: tokenized, then refused
    digits = _post(server, "/v1/completions", b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}").json()
    assert "4,300 digits" in digits["error"]["message"] and "sys." not in digits["error"]["message"]
    big = _post(server, "/v1/completions", b'{"prompt": "' + b"a" * (2 << 20) + b'", "max_tokens": 4}')
    assert big.status_code == 413 and big.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/nothing", timeout=WAIT_S).json()["error"]["code"] == "not_found"
    wait_idle(server)
    assert server.frontend.num_in_flight == 0  # no refused request keeps a slot of --max-in-flight


# -- disconnects -------------------------------------------------------------------------------------
def test_a_client_that_vanishes_mid_stream_is_aborted_and_its_blocks_freed(server):
    before = metrics(server)
    body = {"prompt": "CYNIC, n.", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=WAIT_S) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(line for line in lines if line.startswith("data: {"))
        busy = metrics(server)
        assert core_sum(busy, "kv_cache_usage_perc") > 0  # it holds blocks while it runs
        assert core_sum(busy, "num_requests_running") == 1
        lines.close()  # httpx closes the connection: the client is gone
    after = wait_idle(server)  # the connection closed: the request left the batch, every block is free
    assert reason_count(after, "abort") == reason_count(before, "abort") + 1
    assert reason_count(after, "length") == reason_count(before, "length")  # it did not run to its end
    assert core_sum(after, "engine_core_messages_in_total") == core_sum(before, "engine_core_messages_in_total") + 2


def test_a_waiting_non_streamed_client_that_hangs_up_is_aborted_at_once(server):
    """The client hangs up once its request is running (not after a time: on a busy machine the request might
    not have reached the server by then)."""
    before = metrics(server)
    body = json.dumps({"prompt": "CYNIC, n.", "max_tokens": LONG, "ignore_eos": True}).encode()
    host, port = server.url.rsplit("/", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: core_sum(metrics(server), "num_requests_running") == 1, "the request to be running")
    after = wait_idle(server)  # the connection closed while the answer was being made
    assert reason_count(after, "abort") == reason_count(before, "abort") + 1
    # aborted when the connection closed, long before its 4,000 tokens (not at the next poll of a timer)
    made = f"cbteach:generation_tokens_total{{{LAB}}}"
    assert after[made] - before[made] < LONG


# -- one request that fails inside the engine ---------------------------------------------------------
def test_a_request_that_fails_in_the_engine_ends_alone_with_an_error(server, ref):
    """A fault injected into one request's sampling: that stream ends with an OpenAI-style error event, the same
    request not streamed gets a 500 error body (not a 200 with an odd finish_reason), neither counts as a success,
    and the neighbours in the same batch finish exactly."""
    prompts = headword_prompts(6)
    before = metrics(server)

    async def neighbour(c, prompt):
        r = await c.completions.create(model="bierce", prompt=prompt, max_tokens=30,
                                       extra_body={"return_token_ids": True})
        return r.choices[0].token_ids

    async def failing_stream(c):
        stream = await c.completions.create(model="bierce", prompt="CYNIC, n.", max_tokens=30, stream=True,
                                            extra_body={"cbteach_fail_after": 3})
        got = []
        with pytest.raises(openai.APIError) as err:
            async for chunk in stream:
                got.append(chunk.choices[0].text)
        return got, err.value

    async def go():
        c = client(server)
        try:
            return await asyncio.wait_for(asyncio.gather(failing_stream(c), *(neighbour(c, p) for p in prompts)), 90)
        finally:
            await c.close()

    (pieces, err), *answers = asyncio.run(go())
    assert "failed inside the engine" in str(err) and "fault injected" in str(err)
    assert 0 < len(pieces) <= 3  # its first tokens came, then the error
    for prompt, ids in zip(prompts, answers):
        assert ids == ref(prompt, 30), prompt
    r = httpx.post(server.url + "/v1/completions", timeout=WAIT_S,
                   json={"prompt": "BORE, n.", "max_tokens": 30, "cbteach_fail_after": 0})
    err = r.json()["error"]
    assert r.status_code == 500 and err["type"] == "server_error" and err["code"] == "engine_error"
    after = wait_idle(server)
    assert failure(after, "error") == failure(before, "error") + 2
    done = sum(success(after, k) - success(before, k) for k in ("stop", "length"))
    assert done == len(prompts)  # the neighbours, and nothing else


# -- one message per step, and what crosses the socket -----------------------------------------------
def test_one_message_per_step_and_token_ids_only(server, ref):
    """Sixteen streams at once: the core sends exactly one message per engine step (not one per token per stream),
    a few hundred bytes each; the API server sends one message per request in."""
    before = metrics(server)
    prompts = headword_prompts(16)

    async def one(c, prompt):
        stream = await c.completions.create(model="bierce", prompt=prompt, max_tokens=20, stream=True,
                                            extra_body={"return_token_ids": True})
        chunks = [x async for x in stream]
        return [t for chunk in chunks for ch in chunk.choices for t in (getattr(ch, "token_ids", None) or [])]

    async def go():
        c = client(server)
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(c, p) for p in prompts)), 90)
        finally:
            await c.close()

    results = asyncio.run(go())
    assert results == [ref(p, 20) for p in prompts]
    after = wait_idle(server)
    d = {k: core_sum(after, k) - core_sum(before, k) for k in
         ("engine_core_steps_total", "engine_core_messages_out_total", "engine_core_messages_in_total",
          "engine_core_bytes_out_total")}
    tokens = sum(len(r) for r in results)
    assert d["engine_core_messages_out_total"] == d["engine_core_steps_total"] < tokens / 4
    assert d["engine_core_messages_in_total"] == len(prompts)
    assert d["engine_core_bytes_out_total"] / d["engine_core_messages_out_total"] < 1000


# -- metrics -------------------------------------------------------------------------------------------
def test_metrics_count_what_was_served(server):
    before = metrics(server)
    bodies = [httpx.post(server.url + "/v1/completions", timeout=WAIT_S,
                         json={"prompt": p, "max_tokens": 5}).json() for p in headword_prompts(3)]
    after = wait_idle(server)
    lab = "{" + LAB + "}"
    for name, key in (("prompt_tokens_total", "prompt_tokens"), ("generation_tokens_total", "completion_tokens")):
        grown = after[f"cbteach:{name}{lab}"] - before[f"cbteach:{name}{lab}"]
        assert grown == sum(b["usage"][key] for b in bodies), name
    ttft = f"cbteach:time_to_first_token_seconds_count{lab}"
    assert after[ttft] - before[ttft] == 3
    itl = f"cbteach:inter_token_latency_seconds_count{lab}"
    assert after[itl] - before[itl] == sum(b["usage"]["completion_tokens"] - 1 for b in bodies)
    assert f'cbteach:num_preemptions_total{{{LAB},engine="0"}}' in after
    assert after[f'cbteach:time_to_first_token_seconds_bucket{{{LAB},le="+Inf"}}'] == after[ttft]


def test_live_steps_show_who_ran(server):
    httpx.post(server.url + "/v1/completions", json={"prompt": "BORE, n.", "max_tokens": 3}, timeout=WAIT_S)
    steps = httpx.get(server.url + "/live/steps", timeout=WAIT_S).json()
    assert steps["max_batch_size"] == 8 and steps["num_cores"] == 1
    last = steps["steps"][-3:]
    assert [s["seqs"][0][2] for s in last] == ["prefill", "decode", "decode"]
    assert last[0]["admitted"] and last[-1]["finished"] and last[0]["kv_total"] == NUM_BLOCKS
    assert {s["core"] for s in last} == {0}
    assert "EventSource" in httpx.get(server.url + "/", timeout=WAIT_S).text


# -- the command line ---------------------------------------------------------------------------------
@pytest.mark.parametrize("host, loopback", [("[::1]", True), ("::1", True), ("localhost", True), ("127.0.0.2", True),
                                            ("[::]", False), ("0.0.0.0", False)])
def test_a_bracketed_ipv6_host_is_the_address_inside(host, loopback):
    """``--host [::1]`` (an address as a URL writes it) was taken for a public name: refused without a key, and with
    one, not bindable."""
    bound = srv.parser().parse_args(["--host", host]).host
    assert "[" not in bound and srv.is_loopback(bound) is loopback


def test_refuses_a_public_host_without_a_key_and_names_the_extra(capsys, monkeypatch):
    assert srv.main(["--host", "0.0.0.0"]) == 2
    assert "--api-key" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if the extra were not installed
    assert srv.main([]) == 1
    assert "pip install 'cbteach[serve]'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        srv.main(["--help"])
    out = capsys.readouterr().out
    assert "--max-batch-size" in out and "--data-parallel-size" in out and "--scheduler" in out


def test_a_default_max_tokens_beyond_the_models_positions_is_refused_at_startup(capsys):
    """The model's positions are known once a core has loaded it; a default of all of them (4096) left no room for
    any prompt, and every request without max_tokens got a 400 naming a value it never sent."""
    assert srv.main(["--port", "0", "--default-max-tokens", "4096"]) == 2
    err = capsys.readouterr().err
    assert "cannot start" in err and "--default-max-tokens 4096 leaves no room" in err and "4096 positions" in err


def test_a_max_tokens_cap_beyond_the_models_positions_is_refused_at_startup(capsys):
    """``--max-tokens-cap 10000`` on a 4096-position model was taken: requests for 9000 tokens got a 400 about the
    prompt, and the cap the errors advertised (1 to 4096) held a value no request could have."""
    assert srv.main(["--port", "0", "--max-tokens-cap", "10000"]) == 2
    err = capsys.readouterr().err
    assert "cannot start" in err and "--max-tokens-cap 10000 leaves no room" in err and "at most 4095" in err


def test_an_empty_api_key_is_refused_at_startup(capsys, monkeypatch):
    """An empty key (``--api-key ""``, or ``CBTEACH_API_KEY=`` as compose files leave it) counted as no key for the
    banner and the host check, and as a key for every route: no client could send it, so all got 401."""
    for argv, env in ((["--api-key", ""], None), ([], ""), (["--api-key", " k "], None)):
        if env is None:
            monkeypatch.delenv("CBTEACH_API_KEY", raising=False)
        else:
            monkeypatch.setenv("CBTEACH_API_KEY", env)
        with pytest.raises(SystemExit) as e:
            srv.main(["--port", "0", *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--api-key" in err and ("must not be empty" in err or "space" in err), err


def test_a_piece_that_does_not_import_is_refused_before_anything_starts(capsys):
    assert srv.main(["--port", "0", "--scheduler", "no_such_module_here:MyScheduler"]) == 2
    err = capsys.readouterr().err
    assert "cannot start" in err and "--scheduler" in err and "no_such_module_here" in err and "serving" not in err
    assert srv.main(["--port", "0", "--attention", "cbteach.attention.paged"]) == 2
    assert "MODULE:NAME" in capsys.readouterr().err
