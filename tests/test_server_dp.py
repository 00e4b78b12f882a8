"""``serve --data-parallel-size 2`` with the learner's plug points filled: two engine cores, each with its own
model copy and pool, each running hand-written pieces (``tests/server_pieces.py``); answers exact, both cores
used, requests routed to the least-loaded core, and ``/metrics`` and the live view showing every core."""
import asyncio
import os
import threading

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'cbteach[serve]')")
pytest.importorskip("zmq", reason="the serve extra is not installed (pip install 'cbteach[serve]')")
pytest.importorskip("msgspec", reason="the serve extra is not installed (pip install 'cbteach[serve]')")

from serverkit import LAB, WAIT_S, make_ref, metrics, wait_for, wait_idle  # noqa: E402

from cbteach.bierce.corpus import headword_prompts  # noqa: E402
from cbteach.serving.server import ServerThread  # noqa: E402

PIECES = ["--scheduler", "server_pieces:PlainScheduler", "--kv-manager", "server_pieces:PlainKVManager",
          "--attention", "server_pieces:attention", "--slot-mapping", "server_pieces:slot_mapping"]


@pytest.fixture(scope="module")
def pieces_log(tmp_path_factory):
    path = tmp_path_factory.mktemp("pieces") / "called.txt"
    old = os.environ.get("CBTEACH_PIECES_LOG")
    os.environ["CBTEACH_PIECES_LOG"] = str(path)  # the engine cores inherit it
    yield path
    if old is None:
        os.environ.pop("CBTEACH_PIECES_LOG", None)
    else:
        os.environ["CBTEACH_PIECES_LOG"] = old


@pytest.fixture(scope="module")
def server(pieces_log):
    s = ServerThread(["--port", "0", "--data-parallel-size", "2", "--max-batch-size", "4", *PIECES]).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def ref(bierce):
    return make_ref(*bierce)


def test_two_cores_with_plugged_pieces_answer_exactly_and_both_work(server, ref, pieces_log):
    prompts = headword_prompts(24)
    lengths = [6 + 5 * (i % 4) for i in range(24)]

    async def one(c, prompt, n):
        stream = await c.completions.create(model="bierce", prompt=prompt, max_tokens=n, stream=True,
                                            extra_body={"return_token_ids": True})
        return [t async for chunk in stream for ch in chunk.choices for t in (getattr(ch, "token_ids", None) or [])]

    async def go():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=WAIT_S)
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(c, p, n) for p, n in zip(prompts, lengths))), 120)
        finally:
            await c.close()

    before = metrics(server.url)
    got = asyncio.run(go())
    assert got == [ref(p, n) for p, n in zip(prompts, lengths)]
    after = wait_idle(server.url)
    steps = [after[f'cbteach:engine_core_steps_total{{{LAB},engine="{i}"}}'] -
             before[f'cbteach:engine_core_steps_total{{{LAB},engine="{i}"}}'] for i in (0, 1)]
    assert min(steps) > 0, steps  # both cores stepped
    called = pieces_log.read_text().split()
    for piece in ("scheduler", "kv_manager", "attention", "slot_mapping"):  # in both core processes
        assert len({pid for what, pid in zip(called[::2], called[1::2]) if what == piece}) == 2, (piece, called)


def test_a_new_request_goes_to_the_least_loaded_core(server):
    """One long request holds core 0; the next goes to core 1 (less load), the third to core 0 again when the
    second is longer. Where each went is read from the cores' own count of the messages they received, and
    every stream stays open until the test has read it (then its client leaves and it is aborted): no request
    ends by itself while the test looks, whatever the machine's speed (each would run thousands of steps)."""
    streams = []

    def messages_in():
        m = metrics(server.url)
        return [m[f'cbteach:engine_core_messages_in_total{{{LAB},engine="{i}"}}'] for i in (0, 1)]

    def open_stream(n):
        started, leave = threading.Event(), threading.Event()

        def run():
            body = {"prompt": "CYNIC, n.", "max_tokens": n, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=WAIT_S) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        started.set()
                    if leave.is_set():
                        return  # the client hangs up: its request is aborted in its core
        t = threading.Thread(target=run, daemon=True)
        t.start()
        streams.append((t, leave))
        assert started.wait(WAIT_S), f"no token of the {n}-token stream within {WAIT_S} s"

    def sent(expected, what):
        wait_for(lambda: [a - b for a, b in zip(messages_in(), before)] == expected, what)

    wait_idle(server.url)
    before = messages_in()
    open_stream(3000)
    sent([1, 0], "the first request on core 0 (both idle: the lowest)")
    open_stream(4000)
    sent([1, 1], "the second request on core 1 (less load)")
    open_stream(150)  # core 0 has less left to do (under 3,000 tokens) than core 1 (under 4,000)
    sent([2, 1], "the third request on core 0")
    for t, leave in streams:
        leave.set()
        t.join(WAIT_S)
    wait_idle(server.url)


def test_live_view_and_metrics_show_every_core(server):
    # two choices, routed one after the other before either runs: one on each core, whatever ran before
    httpx.post(server.url + "/v1/completions", json={"prompt": "BORE, n.", "max_tokens": 3, "n": 2}, timeout=WAIT_S)
    live = httpx.get(server.url + "/live/steps", timeout=WAIT_S).json()
    assert live["num_cores"] == 2 and {s["core"] for s in live["steps"]} == {0, 1}
    m = metrics(server.url)
    for name in ("num_requests_running", "kv_cache_usage_perc", "engine_core_steps_total",
                 "engine_core_idle_seconds_total"):
        assert {k for k in m if k.startswith(f"cbteach:{name}{{")} == {
            f'cbteach:{name}{{{LAB},engine="{i}"}}' for i in (0, 1)}
    assert httpx.get(server.url + "/health", timeout=WAIT_S).json()["engine_cores"] == 2


@pytest.mark.timeout(240)
def test_tensor_parallel_size_reaches_the_engine_core(ref):
    """``serve --tensor-parallel-size 2``: the core's engine shards the model over two worker processes
    (cbteach.parallel); greedy answers are still generate's."""
    pytest.importorskip("cbteach.parallel.tp", reason="tensor parallelism is not in this tree")
    with ServerThread(["--port", "0", "--tensor-parallel-size", "2", "--max-batch-size", "4"]) as s:
        r = httpx.post(s.url + "/v1/completions", timeout=WAIT_S * 2,
                       json={"prompt": ["CYNIC, n.", "BORE, n."], "max_tokens": 16, "return_token_ids": True})
        got = [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
        assert got == [ref("CYNIC, n.", 16), ref("BORE, n.", 16)]
