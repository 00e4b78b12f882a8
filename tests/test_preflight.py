"""``python -m cbteach preflight``: ready in a fresh clone of the committed tree, and each failing check
says what is wrong and how to fix it (cbteach/preflight.py, notebooks/WORKSHOP_KIT.md)."""
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cbteach import preflight
from cbteach.__main__ import main

ROOT = Path(__file__).resolve().parents[1]


def test_preflight_is_ready_in_a_fresh_clone(tmp_path):
    """The committed tree, cloned, with this interpreter and the clone first on the path: every check
    passes, the device line names a device the run used, the last line is ``ready``, exit status 0."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (or no git): nothing to clone")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=300)
    env = dict(os.environ, PYTHONPATH=str(clone), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    args = [sys.executable, "-m", "cbteach", "preflight"]
    try:
        importlib.metadata.version("jupyterlab")
    except importlib.metadata.PackageNotFoundError:
        args.append("--no-lab")  # an environment without the lab extra: the rest must still be ready
    out = subprocess.run(args, cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0, out.stdout + out.stderr
    assert lines[-1] == "ready"
    assert lines[0].startswith("cbteach ") and str(clone / "cbteach") in lines[0]  # the clone's code ran
    device = [ln for ln in lines if ln.startswith("device: ")]
    assert len(device) == 1
    used = device[0].split()[1]
    for ln in lines:  # every line naming a device names the one the model ran on
        for named in re.findall(r"\bon (\S+?)\)?$", ln):
            assert named == used, ln
    assert any("engine (paged KV cache): 4/4" in ln for ln in lines)
    assert any("engine (concat KV cache): 4/4" in ln for ln in lines)


def test_a_python_too_old_says_which_and_how_to_fix():
    c = preflight.check_python((3, 9, 18))
    assert not c.ok and c.detail == "3.9.18 is older than 3.10" and "Python 3.10 or newer" in c.fix
    assert preflight.check_python((3, 10, 0)).ok


def test_a_package_out_of_range_or_missing_says_what_was_found_and_what_is_allowed():
    old = preflight.check_package("transformers", "5.0", "6", "pip install x", version_of=lambda d: "4.57.1")
    assert not old.ok and old.detail == "4.57.1 is installed; cbteach needs >=5.0,<6" and old.fix == "pip install x"
    new = preflight.check_package("transformers", "5.0", "6", "fix", version_of=lambda d: "6.0.0")
    assert not new.ok and "needs >=5.0,<6" in new.detail
    assert preflight.check_package("torch", "2.6", None, "fix", version_of=lambda d: "2.13.0+cpu").ok

    def missing(dist):
        raise importlib.metadata.PackageNotFoundError(dist)

    gone = preflight.check_package("jupyterlab", "4", None, "pip install 'cbteach[lab]'", version_of=missing)
    assert not gone.ok and gone.detail == "not installed"
    line = preflight.verdict([preflight.check_python((3, 12, 0)), gone])
    assert line == "not ready: jupyterlab: not installed -- fix: pip install 'cbteach[lab]'"


def test_a_failing_check_ends_in_not_ready_exit_1_and_skips_the_engine(monkeypatch, capsys):
    real = preflight.check_package

    def old_transformers(dist, lowest, below, fix, version_of=None):
        return real(dist, lowest, below, fix, version_of=(lambda d: "4.57.1") if dist == "transformers" else None)

    monkeypatch.setattr(preflight, "check_package", old_transformers)
    monkeypatch.setattr(preflight, "check_engine", lambda device: pytest.fail("the engine ran without its packages"))
    assert main(["preflight", "--no-lab"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert "[FAIL] transformers: 4.57.1 is installed; cbteach needs >=5.0,<6" in lines
    assert lines[-2].startswith("[FAIL] engine: not run")
    assert lines[-1].startswith("not ready: transformers: 4.57.1 is installed; cbteach needs >=5.0,<6 -- fix: "
                                'pip install "transformers>=5.0,<6"')


def test_an_unknown_device_is_a_failed_check_naming_the_allowed_ones():
    checks, used = preflight.check_engine("tpu")
    assert used is None and len(checks) == 1 and not checks[0].ok
    assert checks[0].name == "device" and "'tpu'" in checks[0].detail and "cpu, cuda or mps" in checks[0].fix


def test_the_ranges_checked_are_pyproject_s():
    text = (ROOT / "pyproject.toml").read_text()
    for dist, (lowest, below, _) in {**preflight.CORE, **preflight.LAB}.items():
        want = f'"{dist}>={lowest}' + (f",<{below}" if below else "") + '"'
        assert want in text, (dist, want)


def test_versions_are_read_without_packaging_too(monkeypatch):
    """packaging comes with transformers: where transformers is missing, the version checks still work."""
    monkeypatch.setitem(sys.modules, "packaging.version", None)  # import fails
    assert preflight._release("2.13.0+cpu") == (2, 13, 0)
    c = preflight.check_package("transformers", "5.0", "6", "fix", version_of=lambda d: "4.57.1")
    assert not c.ok and c.detail == "4.57.1 is installed; cbteach needs >=5.0,<6"
