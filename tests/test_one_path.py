"""The one path a learner reads: which files the default engine's step runs, and README's map of them.

``tools/one_path.py`` traces ``Engine(model, tok, max_batch_size=4, kv="paged").step()`` on the
embedded model. These tests keep what it measures from growing back, keep README's reading map equal
to what the step really runs, and hold issue 53's targets as an expected failure until they are met.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("one_path", ROOT / "tools" / "one_path.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


one_path = _tool()


@pytest.fixture(scope="module")
def measured():
    return one_path.measure()


def test_the_reading_map_lists_exactly_what_the_step_runs(measured):
    traced = {Path(r["file"]).relative_to("cbteach").as_posix() for r in measured["rows"]}
    mapped = {f for _, files, _ in one_path.READ_ORDER for f in files}
    assert traced - mapped == set(), "the default step runs files README's reading map does not list"
    assert mapped - traced == set(), "README's reading map lists files the default step does not run"


def test_readme_holds_the_reading_map_at_todays_line_counts():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- one-path map -->\n(.*?)\n<!-- /one-path map -->", text, re.S)
    assert block, "README.md lost its reading map (between the one-path map markers)"
    assert block.group(1) == one_path.map_table(), \
        "README's reading map is stale: paste the output of `python tools/one_path.py --map` between its markers"


# What the default step ran when this test was written (it started at 24 files, 3,732 lines and 357
# variant lines by the tool's pattern). Lower is better: lower these when a change brings them down.
KEPT = {"files": 14, "lines": 2432, "variant_lines": 25}


@pytest.mark.parametrize("what", sorted(KEPT))
def test_the_default_step_does_not_grow(measured, what):
    assert measured[what] <= KEPT[what], (
        f"the default engine's step now runs {measured[what]} {what.replace('_', ' ')} (kept at most "
        f"{KEPT[what]}): what a learner reads grew -- put a variant beside the core, not in it")


def test_the_default_step_runs_no_fork_module(measured):
    """Parallel sampling by fork (V0's copy on write) lives beside the core: the default step runs none of it."""
    traced = {r["file"] for r in measured["rows"]}
    fork_modules = {"cbteach/engine/fork.py", "cbteach/worker/fork_runner.py", "cbteach/kv/fork.py"}
    assert all((ROOT / f).exists() for f in fork_modules)
    assert traced & fork_modules == set(), "the default engine's step runs fork's code"


def test_the_default_engine_imports_no_fork_or_speculative_module():
    """Fork's and speculative decoding's modules are imported only where they are used: building and
    stepping the default engine, in a fresh interpreter, loads none of them."""
    code = ("import sys\nfrom cbteach import Engine, Request, load_model\nmodel, tok = load_model()\n"
            "with Engine(model, tok, max_batch_size=4, kv='paged') as eng:\n"
            "    eng.run([Request('The engine', 3), Request('Ink', 2)])\n"
            "print(sorted(m for m in sys.modules if m.startswith('cbteach') and\n"
            "             any(w in m.rsplit('.', 1)[-1] for w in ('fork', 'spec'))))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", f"the default engine imported a variant's modules: {out.stdout}"


@pytest.mark.xfail(strict=True, reason="issue 53's targets for the one path are not met yet")
def test_issue_53_targets(measured):
    assert measured["files"] <= 14 and measured["lines"] <= 2000 and measured["variant_lines"] <= 25
