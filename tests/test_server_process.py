"""``python -m cbteach serve`` as a user runs it, a process with its engine core beside it: the port it
announces, a port in use, SIGTERM mid-load, a killed engine core, a killed server.

Every process started here is killed in a ``finally`` (:class:`serverkit.Served`); every wait is bounded.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")
pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'cbteach[serve]')")
pytest.importorskip("zmq", reason="the serve extra is not installed (pip install 'cbteach[serve]')")
pytest.importorskip("msgspec", reason="the serve extra is not installed (pip install 'cbteach[serve]')")

from serverkit import WAIT_S, Served, core_sum, gone, metrics, wait_for  # noqa: E402

LONG = {"prompt": "CYNIC, n.", "max_tokens": 3000, "ignore_eos": True}
SHORT = {"prompt": "BORE, n.", "max_tokens": 300, "ignore_eos": True}  # long enough to be in flight at the signal


def stream_events(url, body, started: threading.Event, out: list):
    """A streamed request in a thread: every data line's JSON (or "[DONE]") into ``out``."""
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=WAIT_S) as r:
        out.append(r.status_code)
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                started.set()
    started.set()


def in_flight(url) -> float:
    m = metrics(url)
    return core_sum(m, "num_requests_running") + core_sum(m, "num_requests_waiting")


def refuses(url) -> bool:
    try:
        httpx.get(url + "/health", timeout=2)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False


def background(target, *args) -> threading.Thread:
    t = threading.Thread(target=target, args=args, daemon=True)
    t.start()
    return t


def whole(url, body, out: list):
    try:
        r = httpx.post(url + "/v1/completions", json=body, timeout=WAIT_S)
        out.append((r.status_code, r.json()))
    except httpx.HTTPError as err:
        out.append((None, repr(err)))


def test_port_zero_announces_its_port_and_sigterm_drains_then_stops_both_processes(tmp_path):
    """SIGTERM: no new request is taken, the ones in flight may finish (the short stream does), what is left
    when the drain ends is cut -- a stream with an error event, a whole answer with a 503 -- and both processes
    stop. Each step waits for the state it needs: both long requests in the engine core, then the short one
    streaming, before the signal; the drain begun with all three in flight; the short one finished. The drain
    is ended by a second SIGTERM, not by its timeout (600 s here), so that the short answer finishes within it
    however slow the machine, and the long ones (3,000 tokens) are still running however fast. (The timeout's
    own abort: tests/test_server_logs.py.)"""
    with Served(["--drain-timeout", "600"], tmp_path / "serve.log") as s:
        assert not s.url.endswith(":0") and httpx.get(s.url + "/health", timeout=WAIT_S).status_code == 200
        cores = s.core_pids()
        assert len(cores) == 1
        long_events, short_events, cut = [], [], []
        long_started, short_started = threading.Event(), threading.Event()
        threads = [background(stream_events, s.url, LONG, long_started, long_events),
                   background(whole, s.url, LONG, cut)]
        wait_for(lambda: in_flight(s.url) == 2, "both long requests (the stream and the whole answer) in the core")
        short = background(stream_events, s.url, SHORT, short_started, short_events)
        assert short_started.wait(WAIT_S), short_events
        s.proc.send_signal(signal.SIGTERM)  # drain: no new requests, the ones in flight go on
        wait_for(lambda: "draining:" in s.text(), "the drain to begin")
        assert "draining: no new requests; 3 in flight" in s.text(), s.text()[-3000:]  # the short one too
        short.join(WAIT_S)
        assert not short.is_alive(), f"the short stream did not finish within the drain: {short_events[-3:]}"
        assert short_events[-1] == "[DONE]" and short_events[-2]["choices"][0]["finish_reason"] == "length"
        assert all(t.is_alive() for t in threads), (long_events[-2:], cut)  # still running: 3,000 tokens each
        s.proc.send_signal(signal.SIGTERM)  # the second: abort what is left now, stop the core, exit 0
        assert s.proc.wait(WAIT_S) == 0, s.text()[-3000:]
        for t in threads:
            t.join(WAIT_S)
        # the long stream was cut with an error event, not a finish_reason
        assert long_events[-1] == "[DONE]" and long_events[-2]["error"]["code"] == "aborted", long_events[-3:]
        assert all(e["choices"][0]["finish_reason"] is None for e in long_events[1:-2])
        status, body = cut[0]  # the whole answer cut by shutdown: an error status, not a 200 that pretends
        assert status == 503 and body["error"]["code"] == "aborted", cut
        wait_for(lambda: all(gone(p) for p in cores), "the engine core to exit")
        assert "Traceback" not in s.text()


def test_a_second_sigterm_aborts_what_is_left_without_waiting_out_the_drain(tmp_path):
    """An operator who signals twice will not wait: the requests still in flight end with the abort error at
    once, not after the 600 s drain, and the process exits 0 (the waits below are only bounds). One request
    runs at a time, so the queued ones are still there however fast the machine is."""
    with Served(["--drain-timeout", "600", "--max-batch-size", "1"], tmp_path / "serve.log") as s:
        streams = [([], threading.Event()) for _ in range(3)]
        threads = [background(stream_events, s.url, LONG, started, events) for events, started in streams]
        wait_for(lambda: in_flight(s.url) == 3, "all three requests to be in the engine core")  # (in any order)
        s.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: refuses(s.url), "the drain to start (the port stops taking connections)")
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(WAIT_S) == 0, s.text()[-3000:]
        for t in threads:
            t.join(WAIT_S)
        ends = [events[-2] for events, _ in streams]
        assert all(events[-1] == "[DONE]" for events, _ in streams)
        assert any("error" in e and e["error"]["code"] == "aborted" for e in ends), ends


def test_a_port_in_use_fails_before_anything_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        r = subprocess.run([sys.executable, "-m", "cbteach", "serve", "--port", str(port)], capture_output=True,
                           text=True, timeout=WAIT_S * 2, env=env)
    assert r.returncode == 2
    assert "cannot start" in r.stderr and f"127.0.0.1:{port}" in r.stderr and "in use" in r.stderr
    assert "serving" not in r.stderr and "engine core" not in r.stderr


def health_until_gone(url, out: list):
    """GET /health every 10 ms until the server stops answering: every ``(status, body)`` into ``out``."""
    while True:
        try:
            r = httpx.get(url + "/health", timeout=WAIT_S)
        except httpx.TransportError:
            return
        out.append((r.status_code, r.json()))
        time.sleep(0.01)


def test_a_killed_engine_core_fails_its_requests_turns_health_red_and_the_server_exits_non_zero(tmp_path):
    """/health is red from the core's death until the server exits, a moment later: it is asked every 10 ms, by a
    thread started before the kill, until the server is gone, so an answer in between is seen whatever the load.
    Its message names the core once the server has noticed the death (within a tenth of a second; before that it
    says "an engine core has stopped")."""
    with Served([], tmp_path / "serve.log") as s:
        (core,) = s.core_pids()
        events, cut, started, health = [], [], threading.Event(), []
        threads = [background(stream_events, s.url, LONG, started, events), background(whole, s.url, LONG, cut)]
        assert started.wait(WAIT_S)
        wait_for(lambda: core_sum(metrics(s.url), "num_requests_running") == 2, "both requests to be running")
        poll = background(health_until_gone, s.url, health)
        os.kill(core, signal.SIGKILL)
        for t in threads:
            t.join(WAIT_S)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_dead", events[-3:]
        assert "engine core 0" in events[-2]["error"]["message"]
        assert cut[0][0] == 503 and cut[0][1]["error"]["code"] == "engine_dead"
        assert s.proc.wait(WAIT_S) == 1
        poll.join(WAIT_S)
        red = [i for i, (status, _) in enumerate(health) if status != 200]  # (the first answer may be red already)
        assert red and all(health[i][0] == 503 for i in range(red[0], len(health))), health[-3:]  # red, and stays so
        assert any("engine core 0" in body["error"]["message"] for _, body in health[red[0]:]), health[-3:]
        assert "engine core 0" in s.text()


def test_engine_cores_never_outlive_a_killed_server(tmp_path):
    with Served([], tmp_path / "serve.log") as s:
        cores = s.core_pids()
        assert len(cores) == 1
        s.proc.kill()  # SIGKILL: no drain, no goodbye
        s.proc.wait(WAIT_S)
        wait_for(lambda: all(gone(p) for p in cores), "the orphaned engine cores to exit by themselves")


def test_with_two_cores_a_killed_core_fails_only_its_requests_and_the_other_finishes_exactly(tmp_path, bierce):
    """The server drains when a core dies: the drain timeout is set far beyond any wait here (600 s), so the
    survivor finishes in the drain however slow the machine, and the server exits once it has."""
    from serverkit import make_ref

    ref = make_ref(*bierce)
    with Served(["--data-parallel-size", "2", "--drain-timeout", "600"], tmp_path / "serve.log") as s:
        cores = s.core_pids()  # started in order: core 0, core 1
        doomed, survivor = [], []
        started = [threading.Event(), threading.Event()]
        threads = [background(stream_events, s.url, LONG, started[0], doomed)]  # core 0 (both idle: the lowest)
        assert started[0].wait(WAIT_S)
        body = {"prompt": "BORE, n.", "max_tokens": 60, "return_token_ids": True}
        threads.append(background(stream_events, s.url, body, started[1], survivor))  # core 1: less to do
        assert started[1].wait(WAIT_S)
        os.kill(cores[0], signal.SIGKILL)
        for t in threads:
            t.join(WAIT_S)
        assert doomed[-1] == "[DONE]" and doomed[-2]["error"]["code"] == "engine_dead", doomed[-3:]
        ids = [t for e in survivor[1:] if e != "[DONE]" for c in e.get("choices", []) for t in c.get("token_ids") or []]
        assert ids == ref("BORE, n.", 60) and survivor[-1] == "[DONE]"  # its core went on; it finished exactly
        assert s.proc.wait(WAIT_S) == 1
        wait_for(lambda: all(gone(p) for p in cores), "both engine cores to be gone")
