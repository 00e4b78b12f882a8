"""What the server's log tells an operator: failed requests by id, a drain and what it aborted, periodic
stats, the banner's KV cache and concurrency -- and never an API key. Also ``serve --help``'s text.

One server serves every log check (started as a user starts it; killed in a ``finally``); the rest are
unit checks of :mod:`cbteach.serving.server_logs`. No check depends on the machine's speed: the stats
line is waited for (bounded), the drained request asks for 3,000 tokens against a 0.2 s drain.
"""
import json
import logging
import signal
import threading

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'cbteach[serve]')")
pytest.importorskip("zmq", reason="the serve extra is not installed (pip install 'cbteach[serve]')")

from serverkit import WAIT_S, Served, wait_for  # noqa: E402

from cbteach.serving import server_logs  # noqa: E402
from cbteach.serving.core_messages import Ready  # noqa: E402
from cbteach.serving.server_cli import parser  # noqa: E402

KEY = "sekrit-key-4711"


def test_the_log_names_failed_requests_drains_and_stats_and_never_the_key(tmp_path):
    auth = {"Authorization": f"Bearer {KEY}"}
    args = ["--log-level", "info", "--stats-interval", "0.2", "--fault-injection", "--api-key", KEY,
            "--drain-timeout", "0.2"]
    with Served(args, tmp_path / "serve.log") as s:
        assert httpx.get(f"{s.url}/?key={KEY}", timeout=WAIT_S).status_code == 200  # the live view, in a browser
        r = httpx.post(s.url + "/v1/completions", headers=auth, timeout=WAIT_S,
                       json={"prompt": "BORE, n.", "max_tokens": 20, "cbteach_fail_after": 2, "stream": True})
        events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
        stream_id = events[0]["id"]  # a streamed failure: a 200 in the access log, so the line below is what says it
        assert events[-1]["error"]["code"] == "engine_error"
        wait_for(lambda: "running " in s.text(), "a stats line")
        out, started = [], threading.Event()

        def long():
            with httpx.stream("POST", s.url + "/v1/completions", headers=auth, timeout=WAIT_S,
                              json={"prompt": "CYNIC, n.", "max_tokens": 3000, "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        out.append(json.loads(line[6:]))
                        started.set()
            started.set()
        t = threading.Thread(target=long, daemon=True)
        t.start()
        assert started.wait(WAIT_S)
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(WAIT_S) == 0
        t.join(WAIT_S)
        text = s.text()
    assert KEY not in text and "key=***" in text
    assert f"request {stream_id} " in text and "failed in the engine" in text and "a fault injected" in text
    stats = next(line for line in text.splitlines() if "running " in line)
    assert all(w in stats for w in ("waiting", "KV cache usage", "prompt", "generation", "tokens/s"))
    long_id = out[0]["id"]
    assert out[-1]["error"]["code"] == "aborted", out[-2:]  # the drain's timeout cut the stream with an error event
    assert "draining: no new requests; 1 in flight" in text
    assert f"aborting 1 request still in flight: {long_id}" in text
    assert "drain done in" in text and f"1 request aborted ({long_id})" in text
    assert "KV cache per engine core:" in text and "maximum concurrency at" in text


def test_the_access_log_filter_hides_a_key_in_any_url():
    record = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d', (
        "127.0.0.1:1", "GET", f"/live/steps?since=3&key={KEY}&x=1", "1.1", 200), None)
    server_logs.RedactKeys().filter(record)
    assert KEY not in record.getMessage() and "key=***&x=1" in record.getMessage()


def ready(**kw):
    return Ready(**{"core": 0, "pid": 1, "max_positions": 4096, "vocab_size": 2048, "max_batch_size": 8,
                    "kv_kind": "paged", "num_blocks": 512, "block_size": 16, **kw})


def test_the_banner_gives_the_kv_cache_in_tokens_and_blocks_and_the_concurrency_it_allows():
    args = parser().parse_args([])
    (line,) = server_logs.banner_lines(args, [ready()])
    assert "8,192 tokens (512 blocks of 16)" in line  # 512 x 16
    assert "at 4,096 tokens per request" in line and "2.00x" in line  # 8,192 / 4,096, under the 8 slots
    (line,) = server_logs.banner_lines(args, [ready(num_blocks=100_000)])
    assert "8.00x" in line  # the batch slots bound it


def test_the_banner_warns_when_the_cores_threads_outnumber_the_processors():
    n = server_logs.processors()
    args = parser().parse_args(["--data-parallel-size", "2", "--threads", str(n)])
    warning = server_logs.banner_lines(args, [ready()])[-1]
    assert warning.startswith("warning:") and f"= {2 * n} threads on {n} processor" in warning
    assert len(server_logs.banner_lines(parser().parse_args([]), [ready()])) == 1  # 1 core x 1 thread: no warning


def test_serve_help_says_each_default_once_and_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["--help"])
    text = capsys.readouterr().out
    assert "(default: None)" not in text and "(default: False)" not in text
    flat = " ".join(text.split())
    assert "(default: --model) (default:" not in flat and "default: $CBTEACH_API_KEY, else none)" in flat
    assert "--log-level {critical,error,warning,info,debug} what the server logs" in flat


@pytest.mark.parametrize("argv, named", [
    (["--kv", "concat", "--block-size", "16"], "--block-size"),  # refused even at the default's value
    (["--kv", "concat", "--num-blocks", "64", "--prefix-caching"], "--num-blocks, --prefix-caching"),
    (["--kv", "concat", "--kv-memory-bytes", "1000000"], "--kv-memory-bytes"),
    (["--kv", "concat", "--preemption", "swap"], "--preemption"),  # (accepted, and V0's scheduler picked, before)
])
def test_serve_refuses_paged_only_options_with_kv_concat(argv, named, capsys):
    from cbteach.serving.server import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert named in err and "paged KV cache only" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, named", [
    (["--default-max-tokens", "100", "--max-tokens-cap", "8"], "--default-max-tokens 100 is more than --max-tokens-cap 8"),
    (["--max-n", "4", "--max-in-flight", "3"], "--max-n 4 is more than --max-in-flight 3"),
])
def test_serve_refuses_caps_that_contradict_each_other(argv, named, capsys):
    """A default above the cap would refuse every request that gives no max_tokens (with a message about a value
    the client never sent); a request of --max-n choices above --max-in-flight could never be taken."""
    from cbteach.serving.server import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


@pytest.mark.parametrize("argv, named", [
    (["--requests", "4"], "--requests"),
    (["--batch-size", "2"], "--max-batch-size/--batch-size"),
    (["--workload", "poisson", "--rate", "5"], "--workload, --rate"),
])
def test_bench_reference_refuses_workload_options(argv, named, tmp_path, capsys):
    from cbteach.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "--reference", "--json", str(tmp_path / "x.json"), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--reference" in err and named in err


@pytest.mark.parametrize("argv, named", [
    (["--startup-timeout", "inf"], "argument --startup-timeout: must be a finite number > 0"),
    (["--served-model-name", " "], "argument --served-model-name: must not be empty"),
    (["--served-model-name", " x"], "has spaces at an end"),  # (accepted; no client sending "x" was served)
    (["--host", "[]"], "argument --host: '[]' is not a host name or address"),
])
def test_serve_refuses_an_endless_timeout_and_an_empty_name(argv, named, capsys):
    from cbteach.serving.server import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and named in capsys.readouterr().err
