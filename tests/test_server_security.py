"""What an operator found when trying the server, each fixed: the API key guards every route but /health (the
live view takes it once, as /?key=, then by cookie), live-view listeners are capped, slow clients are cut off
(headers, body) and connections are capped; a request the KV pool can never hold is refused by the core."""
import socket
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'cbteach[serve]')")
pytest.importorskip("zmq", reason="the serve extra is not installed (pip install 'cbteach[serve]')")
pytest.importorskip("msgspec", reason="the serve extra is not installed (pip install 'cbteach[serve]')")

from serverkit import WAIT_S, wait_for  # noqa: E402

from cbteach.serving.server import ServerThread  # noqa: E402

KEY = "sesame"
OK = {"Authorization": f"Bearer {KEY}"}
HEADER_TIMEOUT, BODY_TIMEOUT, MAX_CONNECTIONS = 2, 1, 6


@pytest.fixture(scope="module")
def server():
    s = ServerThread(["--port", "0", "--api-key", KEY, "--num-blocks", "4", "--max-live-listeners", "2",
                      "--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
                      "--max-connections", str(MAX_CONNECTIONS)]).start()
    try:
        yield s
    finally:
        s.stop()


def read_all(sock) -> bytes:
    """Everything the server sends until it closes the connection (each recv bounded by the socket's timeout)."""
    parts = []
    while True:
        part = sock.recv(4096)
        if not part:
            return b"".join(parts)
        parts.append(part)


def host_port(server):
    host, port = server.url.rsplit("/", 1)[1].rsplit(":", 1)
    return host, int(port)


def test_the_api_key_guards_every_route_but_health(server):
    body = {"prompt": "x", "max_tokens": 2}
    routes = [("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/"),
              ("GET", "/live/steps"), ("GET", "/live/steps?since=abc"), ("GET", "/live/events")]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path in routes:
            r = httpx.request(method, server.url + path, json=body, headers=headers, timeout=WAIT_S)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers)
    assert httpx.post(server.url + "/v1/completions", json=body, headers=OK, timeout=WAIT_S).status_code == 200
    assert httpx.get(server.url + "/v1/models", headers=OK, timeout=WAIT_S).json()["data"][0]["id"] == "bierce"
    assert "cbteach:num_requests_running" in httpx.get(server.url + "/metrics", headers=OK, timeout=WAIT_S).text
    assert httpx.get(server.url + "/health", timeout=WAIT_S).status_code == 200
    assert httpx.get(server.url + "/?key=wrong", timeout=WAIT_S).status_code == 401
    with httpx.Client(base_url=server.url, timeout=WAIT_S) as browser:  # a browser: no headers, a cookie
        page = browser.get(f"/?key={KEY}")
        assert page.status_code == 200 and "EventSource" in page.text
        assert browser.get("/live/steps").status_code == 200  # the cookie the page got
        bad = browser.get("/live/steps?since=abc")  # the key first, then the query: a 400 in OpenAI's shape
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "since", bad.text
        assert browser.get("/metrics").status_code == 401  # the cookie is for the live view only
        assert browser.post("/v1/completions", json=body).status_code == 401


def test_a_request_the_pool_can_never_hold_is_refused_by_the_engine_core(server):
    too_big = {"prompt": "x y", "max_tokens": 64}  # 66 tokens; the pool holds 4 blocks of 16
    r = httpx.post(server.url + "/v1/completions", json=too_big, headers=OK, timeout=WAIT_S)
    assert r.status_code == 400 and "KV" in r.json()["error"]["message"] and "'r" not in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "prompt"
    two = httpx.post(server.url + "/v1/completions", json={"prompt": ["x", "x y"], "max_tokens": 64}, headers=OK,
                     timeout=WAIT_S)  # a batch whose first prompt fits and second does not: named
    assert two.status_code == 400 and "prompt 1 of this request" in two.json()["error"]["message"], two.text
    chat = httpx.post(server.url + "/v1/chat/completions", headers=OK, timeout=WAIT_S,
                      json={"messages": [{"role": "user", "content": "x y"}], "max_completion_tokens": 64})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages", chat.text  # (a chat has no prompt)


def test_live_view_listeners_are_capped(server):
    with httpx.Client(base_url=server.url, headers=OK, timeout=WAIT_S) as c:
        with c.stream("GET", "/live/events") as a, c.stream("GET", "/live/events") as b:
            assert a.status_code == b.status_code == 200
            third = c.get("/live/events")
            assert third.status_code == 503 and third.json()["error"]["code"] == "too_many_listeners"
        wait_for(lambda: not server.frontend.hub.listeners, "the two closed pages to give their places back")
        with c.stream("GET", "/live/events") as again:
            assert again.status_code == 200


def test_slow_headers_are_cut_off_and_connections_are_capped(server):
    host, port = host_port(server)
    slow = socket.create_connection((host, port), timeout=WAIT_S)
    try:
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # ... and the rest never comes
        t = time.monotonic()
        reply = read_all(slow)  # ... until the server closes the connection
        assert reply.startswith(b"HTTP/1.1 408") and b"--header-timeout" in reply
        assert time.monotonic() - t < WAIT_S
    finally:
        slow.close()
    idle = [socket.create_connection((host, port), timeout=WAIT_S) for _ in range(MAX_CONNECTIONS)]
    try:
        extra = socket.create_connection((host, port), timeout=WAIT_S)
        try:
            reply = read_all(extra)
            assert reply.startswith(b"HTTP/1.1 503") and b"too_many_connections" in reply
        finally:
            extra.close()
    finally:
        for s in idle:
            s.close()
    assert httpx.get(server.url + "/health", timeout=WAIT_S).status_code == 200  # the server is fine


def test_a_body_that_never_arrives_gets_408(server):
    host, port = host_port(server)
    with socket.create_connection((host, port), timeout=WAIT_S) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
        reply = read_all(s)
    assert reply.startswith(b"HTTP/1.1 408") and b"did not arrive" in reply
