"""The live view in a real browser: the page at ``/`` redraws the batch while requests are served.

Starts the server on 127.0.0.1 in this process, opens ``/`` in headless Chromium driven by Playwright
(found as ``test_browser.py`` finds it: Debian's ``chromium`` or ``CBTEACH_CHROMIUM``; Playwright's
own browser download is not used), sends streamed requests from background threads -- each held open
until the page has shown what the test looks for, so a slow page cannot miss the batch -- and checks
that the page's step counter and running count move and that the timeline canvas is drawn. Without Playwright or
Chromium the test is skipped and says why. Every wait is bounded; the browser may only reach 127.0.0.1.
"""
import threading
from urllib.parse import urlsplit

import pytest

from test_browser import CHROMIUM_ARGS, start_playwright

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'cbteach[serve]')")
pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install 'cbteach[serve]')")

WAIT_MS = 30_000


@pytest.fixture
def page(tmp_path):
    pw, chromium = start_playwright()
    context = None
    try:
        context = pw.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=chromium,
                                                        headless=True, args=CHROMIUM_ARGS,
                                                        viewport={"width": 1400, "height": 900})
        context.route("**/*", lambda route: route.continue_()
                      if urlsplit(route.request.url).hostname in ("127.0.0.1", None, "") else route.abort())
        yield context.pages[0] if context.pages else context.new_page()
    finally:
        if context is not None:
            context.close()
        pw.stop()


def test_live_view_redraws_while_requests_stream(page):
    from cbteach.serving.server import ServerThread

    with ServerThread(["--port", "0", "--max-batch-size", "4"]) as server:
        page.goto(server.url + "/", wait_until="domcontentloaded", timeout=WAIT_MS)
        page.wait_for_function("() => document.getElementById('status').textContent === 'live'", timeout=WAIT_MS)
        assert page.inner_text("#seen") == "0"

        leave = threading.Event()

        def client(word):  # a stream the test ends itself (the client leaves) once the page has shown it
            body = {"prompt": f"{word}, n.", "max_tokens": 3000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", server.url + "/v1/completions", json=body,
                              timeout=httpx.Timeout(60, read=300)) as r:  # (a queued one is silent until let go)
                for _ in r.iter_lines():
                    if leave.is_set():
                        return

        # six clients, more than the four slots: some wait. Each runs until the test lets it go, so the page
        # sees the batch while it is there whatever the machine's speed (not only if it looks in time).
        senders = [threading.Thread(target=client, args=(w,), daemon=True)
                   for w in ("CYNIC", "BORE", "ALONE", "EXECUTIVE", "DEBT", "FRIEND")]
        for t in senders:
            t.start()
        page.wait_for_function("() => Number(document.getElementById('seen').textContent) > 0", timeout=WAIT_MS)
        first = int(page.inner_text("#seen"))
        page.wait_for_function(f"() => Number(document.getElementById('seen').textContent) > {first}",
                               timeout=WAIT_MS)  # it keeps updating while the requests run
        page.wait_for_function("() => Number(document.getElementById('running').textContent) > 1", timeout=WAIT_MS)
        assert "/" in page.inner_text("#kv")
        drawn = page.evaluate("""() => { const c = document.getElementById('timeline');
            const d = c.getContext('2d').getImageData(70, 20, c.width - 70, c.height - 50).data;
            let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n; }""")
        assert drawn > 0, "the timeline canvas shows no step"
        leave.set()
        for t in senders:
            t.join(60)
        assert not any(t.is_alive() for t in senders)
