"""``python -m cbteach serve`` over real HTTP on 127.0.0.1: exact answers, bad input, disconnects, auth, metrics.

Every answer is compared with transformers' own ``model.generate`` on one prompt at a time (greedy,
bierce). Clients are the official ``openai`` package (async, many streams at once) and httpx. Every
wait is bounded; nothing is timed.
"""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'cbteach[serve]')")
pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install 'cbteach[serve]')")

from cbteach.bierce.corpus import headword_prompts  # noqa: E402
from cbteach.serving import server as srv  # noqa: E402
from cbteach.serving.server_metrics import parse  # noqa: E402

NUM_BLOCKS = 300  # 4,800 tokens: room for a 4,000-token answer that is still running when its client leaves
LONG = 4000
WAIT_S = 30


@pytest.fixture(scope="module")
def server():
    s = srv.ServerThread(["--port", "0", "--num-blocks", str(NUM_BLOCKS), "--max-batch-size", "8"]).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ref(bierce):
    """Greedy per-prompt ``generate``: ``ref(prompt ids or text, n) -> output ids``, cached."""
    model, tok = bierce
    cache = {}

    def run(prompt, n):
        ids = tuple(tok(prompt)["input_ids"]) if isinstance(prompt, str) else tuple(prompt)
        if (ids, n) not in cache:
            x = torch.tensor([ids])
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                                 eos_token_id=model.generation_config.eos_token_id,
                                 pad_token_id=model.generation_config.eos_token_id)
            cache[(ids, n)] = out[0, len(ids):].tolist()
        return cache[(ids, n)]

    run.tok = tok
    return run


def text_of(ref, ids):
    return ref.tok.decode(ids, skip_special_tokens=True)


def metrics(server) -> dict:
    return parse(httpx.get(server.url + "/metrics", timeout=WAIT_S).text)


def wait_idle(server) -> dict:
    """Poll /metrics until nothing runs or waits and every KV block is free (bounded); return the scrape."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        m = metrics(server)
        if m['cbteach:num_requests_running{model_name="bierce"}'] == 0 and \
                m['cbteach:num_requests_waiting{model_name="bierce"}'] == 0 and \
                m['cbteach:kv_cache_usage_perc{model_name="bierce"}'] == 0:
            return m
        time.sleep(0.1)
    pytest.fail(f"the server did not become idle with every block free within {WAIT_S} s: {m}")


def reason_count(m, reason) -> float:
    return m[f'cbteach:request_success_total{{model_name="bierce",finished_reason="{reason}"}}']


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


# -- bad input ---------------------------------------------------------------------------------------
BAD = [
    (b"{not json", 400, None), (b"[1, 2]", 400, None),
    ({"model": "gpt-4", "prompt": "x", "max_tokens": 4}, 404, "model"),
    ({"prompt": "x"}, 400, "max_tokens"), ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"), ({"prompt": "x", "max_tokens": 10 ** 6}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": "10"}, 400, "max_tokens"), ({"prompt": "x", "max_tokens": 4.5}, 400, "max_tokens"),
    ({"prompt": 5, "max_tokens": 4}, 400, "prompt"), ({"prompt": "", "max_tokens": 4}, 400, "prompt"),
    ({"prompt": [], "max_tokens": 4}, 400, "prompt"), ({"prompt": [1, "a"], "max_tokens": 4}, 400, "prompt"),
    ({"prompt": [1, -3], "max_tokens": 4}, 400, "prompt"), ({"prompt": [99999], "max_tokens": 4}, 400, None),
    ({"prompt": "x", "max_tokens": 4, "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "x", "max_tokens": 4, "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "max_tokens": 4, "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "max_tokens": 4, "n": 0}, 400, "n"), ({"prompt": "x", "max_tokens": 4, "n": 99}, 400, "n"),
    ({"prompt": "x", "max_tokens": 4, "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "max_tokens": 4, "stop": 5}, 400, "stop"), ({"prompt": "x", "max_tokens": 4, "seed": -2}, 400, "seed"),
    ({"prompt": "x", "max_tokens": 4, "logprobs": 3}, 400, "logprobs"),
    ({"prompt": [7] * 4090, "max_tokens": 10}, 400, None),  # longer than the model's 4,096 positions
]
BAD_CHAT = [({"messages": "hi", "max_tokens": 4}, 400, "messages"), ({"messages": [], "max_tokens": 4}, 400, "messages"),
            ({"messages": [{"role": "wizard", "content": "x"}], "max_tokens": 4}, 400, "messages"),
            ({"messages": [{"role": "user", "content": 3}], "max_tokens": 4}, 400, "messages"),
            ({"messages": [{"role": "user", "content": "x"}]}, 400, "max_completion_tokens")]


def _post(server, path, body):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    return httpx.post(server.url + path, timeout=WAIT_S, **kw)


def test_bad_input_gets_an_openai_error_and_disturbs_nobody(server, ref):
    """While one long answer streams, every kind of bad input is refused with a 4xx; the stream stays exact."""
    body = {"prompt": "EXECUTIVE, n.", "max_tokens": 200, "stream": True, "return_token_ids": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=WAIT_S) as live:
        lines = live.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))  # it is running now
        cases = [("/v1/completions", b, s, p) for b, s, p in BAD] + [("/v1/chat/completions", b, s, p)
                                                                    for b, s, p in BAD_CHAT]
        for path, bad, status, param in cases:
            r = _post(server, path, bad)
            assert r.status_code == status, (bad if isinstance(bad, bytes) else str(bad)[:80], r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
            assert err["param"] == param, (str(bad)[:80], err)
        rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    ids = [t for e in [json.loads(first[6:])] + rest for t in e["choices"][0].get("token_ids", [])]
    assert ids == ref("EXECUTIVE, n.", 200)
    big = _post(server, "/v1/completions", b'{"prompt": "' + b"a" * (2 << 20) + b'", "max_tokens": 4}')
    assert big.status_code == 413 and big.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/nothing", timeout=WAIT_S).json()["error"]["code"] == "not_found"
    wait_idle(server)


# -- disconnects -------------------------------------------------------------------------------------
def test_a_client_that_vanishes_mid_stream_is_aborted_and_its_blocks_freed(server):
    before = metrics(server)
    body = {"prompt": "CYNIC, n.", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=WAIT_S) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(line for line in lines if line.startswith("data: {"))
        busy = metrics(server)
        assert busy['cbteach:kv_cache_usage_perc{model_name="bierce"}'] > 0  # it holds blocks while it runs
        assert busy['cbteach:num_requests_running{model_name="bierce"}'] == 1
        lines.close()  # httpx closes the connection: the client is gone
    after = wait_idle(server)  # the connection closed: the request left the batch, every block is free
    assert reason_count(after, "abort") == reason_count(before, "abort") + 1
    assert reason_count(after, "length") == reason_count(before, "length")  # it did not run to its end


def test_a_waiting_non_streamed_client_that_hangs_up_is_aborted(server):
    before = metrics(server)
    body = {"prompt": "CYNIC, n.", "max_tokens": LONG, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(WAIT_S, read=0.5))
    after = wait_idle(server)
    assert reason_count(after, "abort") == reason_count(before, "abort") + 1
    assert reason_count(after, "length") == reason_count(before, "length")  # it did not run to its end


# -- metrics -------------------------------------------------------------------------------------------
def test_metrics_count_what_was_served(server):
    before = metrics(server)
    bodies = [httpx.post(server.url + "/v1/completions", timeout=WAIT_S,
                         json={"prompt": p, "max_tokens": 5}).json() for p in headword_prompts(3)]
    after = wait_idle(server)
    lab = '{model_name="bierce"}'
    for name, key in (("prompt_tokens_total", "prompt_tokens"), ("generation_tokens_total", "completion_tokens")):
        grown = after[f"cbteach:{name}{lab}"] - before[f"cbteach:{name}{lab}"]
        assert grown == sum(b["usage"][key] for b in bodies), name
    ttft = f"cbteach:time_to_first_token_seconds_count{lab}"
    assert after[ttft] - before[ttft] == 3
    itl = f"cbteach:inter_token_latency_seconds_count{lab}"
    assert after[itl] - before[itl] == sum(b["usage"]["completion_tokens"] - 1 for b in bodies)
    assert f"cbteach:num_preemptions_total{lab}" in after
    assert after['cbteach:time_to_first_token_seconds_bucket{model_name="bierce",le="+Inf"}'] == after[ttft]


def test_live_steps_show_who_ran(server):
    httpx.post(server.url + "/v1/completions", json={"prompt": "BORE, n.", "max_tokens": 3}, timeout=WAIT_S)
    steps = httpx.get(server.url + "/live/steps", timeout=WAIT_S).json()
    assert steps["max_batch_size"] == 8
    last = steps["steps"][-3:]
    assert [s["seqs"][0][2] for s in last] == ["prefill", "decode", "decode"]
    assert last[0]["admitted"] and last[-1]["finished"] and last[0]["kv_total"] == NUM_BLOCKS
    assert "EventSource" in httpx.get(server.url + "/", timeout=WAIT_S).text


# -- auth, safety, the command line -------------------------------------------------------------------
def test_api_key_guards_v1_but_not_health_or_metrics_and_a_request_too_big_for_the_pool_is_refused():
    with srv.ServerThread(["--port", "0", "--api-key", "sesame", "--num-blocks", "4"]) as s:
        body = {"prompt": "x", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
                r = httpx.request(method, s.url + path, json=body, headers=headers, timeout=WAIT_S)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        ok = {"Authorization": "Bearer sesame"}
        assert httpx.post(s.url + "/v1/completions", json=body, headers=ok, timeout=WAIT_S).status_code == 200
        assert httpx.get(s.url + "/v1/models", headers=ok, timeout=WAIT_S).json()["data"][0]["id"] == "bierce"
        assert httpx.get(s.url + "/health", timeout=WAIT_S).status_code == 200
        assert httpx.get(s.url + "/metrics", timeout=WAIT_S).status_code == 200
        too_big = {"prompt": "x y", "max_tokens": 64}  # 66 tokens; the pool holds 4 blocks of 16
        r = httpx.post(s.url + "/v1/completions", json=too_big, headers=ok, timeout=WAIT_S)
        assert r.status_code == 400 and "KV" in r.json()["error"]["message"], r.text


def test_refuses_a_public_host_without_a_key_and_names_the_extra(capsys, monkeypatch):
    assert srv.main(["--host", "0.0.0.0"]) == 2
    assert "--api-key" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if the extra were not installed
    assert srv.main([]) == 1
    assert "pip install 'cbteach[serve]'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        srv.main(["--help"])
    assert "--max-batch-size" in capsys.readouterr().out


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_ends_in_flight_streams_and_exits_cleanly(tmp_path):
    """As a user would run it: the command in a subprocess; SIGTERM while a stream runs."""
    port = _free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "cbteach.serving.server", "--port", str(port),
                             "--drain-timeout", "1"], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)
        body = {"prompt": "CYNIC, n.", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=WAIT_S) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            proc.send_signal(signal.SIGTERM)
            rest = list(lines)  # the stream ends: it was aborted after the drain timeout
        assert proc.wait(timeout=WAIT_S) == 0, (tmp_path / "serve.log").read_text()
        finals = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in rest if line.startswith("data: {")]
        assert finals and finals[-1] == "abort"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
