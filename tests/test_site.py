"""The course website (``make book``, tools/build_site.py): built offline from the stored notebooks,
and every page checked in a real browser.

The helpers are tested directly (a widget becomes its last image, links into the repository
are made absolute). The browser test serves the built site on 127.0.0.1 and opens every page in
headless Chromium driven by Playwright, as tests/test_browser.py does (Debian's ``chromium`` or
``CBTEACH_CHROMIUM``; skipped with the reason when either is missing): each page loads without a
script error and shows the Colab / run-locally bar, every image on it has loaded, every link to
another page of the site (and its #anchor) exists, and the search page finds ``block_table``. The
browser may only reach 127.0.0.1, and the site must not try to fetch anything else.

The site in ``site/`` is used when ``make test`` has just built it; otherwise the test builds one
into a temporary folder (about a minute).
"""
from __future__ import annotations

import functools
import http.server
import re
import sys
import threading
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import build_site  # noqa: E402
from test_browser import CHROMIUM_ARGS, start_playwright  # noqa: E402

PAGE_LOAD_S = 30
SEARCH_S = 30
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))


def test_a_widget_becomes_its_last_image_and_its_state_is_dropped():
    state = {"box": {"model_name": "VBoxModel", "state": {"children": ["IPY_MODEL_slider", "IPY_MODEL_out"]}},
             "slider": {"model_name": "IntSliderModel", "state": {"value": 3}},
             "out": {"model_name": "OutputModel", "state": {"outputs": [
                 {"output_type": "display_data", "data": {"image/png": "AAAA", "text/plain": "<Figure>"}},
                 {"output_type": "display_data", "data": {"image/png": "BBBB", "text/plain": "<Figure>"}}]}},
             "bar": {"model_name": "HBoxModel", "state": {"children": ["IPY_MODEL_t"]}},
             "t": {"model_name": "HTMLModel", "state": {"value": "generating:\u2007100%"}}}
    view = "application/vnd.jupyter.widget-view+json"
    nb = {"metadata": {"widgets": {"application/vnd.jupyter.widget-state+json": {"state": state}}},
          "cells": [{"cell_type": "code", "outputs": [{"output_type": "display_data", "data": {view: {"model_id": m}}}]}
                    for m in ("box", "bar", "gone")]}
    out = build_site.static_notebook(nb)
    assert "widgets" not in out["metadata"]
    got = [c["outputs"][0]["data"] for c in out["cells"]]
    assert got[0]["image/png"] == "BBBB"  # the last image drawn
    assert got[1] == {"text/plain": "generating: 100%"}
    assert "run the notebook" in got[2]["text/plain"]


def test_links_into_the_repository_become_site_pages_or_absolute():
    pages = {"notebooks/01_static_batching.ipynb": "01_static_batching.ipynb", "README.md": "index.md"}
    blob = "https://example.org/repo/blob/v1"
    text = ("[one](notebooks/01_static_batching.ipynb#the-barrier) [card](cbteach/bierce/MODEL_CARD.md) "
            "[web](https://a.b/c) [here](#anchor)")
    got = build_site.rewrite_links(text, ".", pages, blob)
    assert got == ("[one](01_static_batching.ipynb#the-barrier) [card](https://example.org/repo/blob/v1/cbteach/"
                   "bierce/MODEL_CARD.md) [web](https://a.b/c) [here](#anchor)")
    assert build_site.rewrite_links("[back](../README.md)", "notebooks", pages, blob) == "[back](index.md)"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    built = ROOT / "site"
    if (built / "searchindex.js").exists() and all((built / f"{n}.html").exists() for n in NOTEBOOKS):
        return built
    tmp = tmp_path_factory.mktemp("site")
    return build_site.build(tmp / "html", work=tmp / "work")


def test_the_site_has_a_page_per_notebook_and_the_course_pages(site):
    for name in NOTEBOOKS + ["index", "glossary", "instructor", "search"]:
        assert (site / f"{name}.html").exists(), name
        assert name == "search" or "cbteach-colab" in (site / f"{name}.html").read_text()
    assert sorted(p.stem for p in (site / "notebooks").glob("*.ipynb")) == NOTEBOOKS  # download targets
    assert "block_tabl" in (site / "searchindex.js").read_text()
    for page in site.glob("*.html"):  # nothing is loaded from outside the site
        assert not re.search(r"<(script|link|img)[^>]+(src|href)=\"(https?:)?//", page.read_text()), page.name


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def served(site):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """A headless Chromium context that may only reach 127.0.0.1; yields ``(context, outside)``,
    ``outside`` collecting every request to anywhere else (blocked)."""
    pw, chromium = start_playwright()
    outside: list[str] = []
    context = None
    try:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=chromium, headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1300, "height": 900})

        def local_only(route):
            if urlsplit(route.request.url).hostname in ("127.0.0.1", None, ""):
                route.continue_()
            else:
                outside.append(route.request.url)
                route.abort()

        context.route("**/*", local_only)
        yield context, outside
    finally:
        if context is not None:
            context.close()
        pw.stop()


BROKEN_IMAGES = "() => [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src)"
LINKS = "() => [...document.querySelectorAll('a[href]')].map(a => a.href)"


def _ids(path: Path) -> set[str]:
    return set(re.findall(r'\bid="([^"]+)"', path.read_text(encoding="utf-8")))


def test_every_page_loads_with_its_images_and_working_links(site, served, browser):
    context, outside = browser
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    problems = []
    ids: dict[Path, set[str]] = {}
    for html in sorted(site.glob("*.html")):
        response = page.goto(f"{served}/{html.name}", wait_until="load", timeout=PAGE_LOAD_S * 1000)
        if response is None or response.status != 200:
            problems.append(f"{html.name}: HTTP {response.status if response else 'no response'}")
            continue
        if html.stem != "search" and html.stem != "genindex" and page.locator(".cbteach-run").count() != 1:
            problems.append(f"{html.name}: no Colab / run-locally bar")
        problems += [f"{html.name}: image did not load: {src}" for src in page.evaluate(BROKEN_IMAGES)]
        if html.stem in NOTEBOOKS and page.locator("article img").count() == 0:
            problems.append(f"{html.name}: a notebook page without a single figure")
        for href in page.evaluate(LINKS):
            parts = urlsplit(href)
            if not href.startswith(served):
                continue
            target = site / unquote(parts.path).lstrip("/")
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                problems.append(f"{html.name}: broken link {href}")
            elif parts.fragment and target.suffix == ".html":
                if parts.fragment not in ids.setdefault(target, _ids(target)):
                    problems.append(f"{html.name}: link to a missing anchor {href}")
    assert not problems, "\n".join(sorted(set(problems)))
    assert not errors, errors
    assert not outside, f"the site tried to fetch from outside: {sorted(set(outside))[:5]}"


def test_search_finds_block_table(served, browser):
    context, _ = browser
    page = context.new_page()
    page.goto(f"{served}/search.html?q=block_table", wait_until="load", timeout=PAGE_LOAD_S * 1000)
    page.wait_for_selector("ul.search li a", timeout=SEARCH_S * 1000)
    hits = page.evaluate("() => [...document.querySelectorAll('ul.search li a')].map(a => a.getAttribute('href'))")
    assert any(h.split("#")[0].split("?")[0] in {f"{n}.html" for n in NOTEBOOKS} | {"index.html", "glossary.html"}
               for h in hits), hits
