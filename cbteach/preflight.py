"""``python -m cbteach preflight``: is this machine ready for the workshop? One line per check, then
one final line -- ``ready``, or what is missing and how to fix it -- and exit status 0 or 1.

Why a command and not "run notebook 00": on the morning of a workshop 30 laptops must be checked in
minutes, Windows has no ``make``, and a failure half-way through a notebook names neither the cause nor
the fix. The checks, in order (each later one needs the earlier ones):

1. the Python version (cbteach needs 3.10 or newer);
2. the installed versions of torch, transformers and -- unless ``--no-lab`` or inside Colab, which has
   its own front end -- JupyterLab and ipywidgets, against the ranges ``pyproject.toml`` asks for;
3. the embedded model, loaded offline (``HF_HUB_OFFLINE=1`` is set for this process: nothing is fetched);
4. a tiny engine run -- four prompts, two slots, so a finished request's slot is refilled -- with the
   concatenating KV cache and with the paged one, each compared token for token with greedy per-prompt
   ``model.generate``. Both engines, because the paged one is the one that failed on the last GPU run
   (``benchmarks/results/README.md``): on a GPU this is the quickest check that it is right there now.

The device line names the device the model's weights are on after loading -- the one the engine ran
on -- never one that was merely available. Everything printed is ASCII (a Windows console's code page).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import sys
from dataclasses import dataclass

MIN_PYTHON = (3, 10)
# distribution -> (lowest version, first version not allowed or None, the install line that fixes it);
# kept in step with pyproject.toml (tests/test_preflight.py checks the floors against it).
CORE = {
    "torch": ("2.6", None, "pip install \"torch>=2.6\" (CPU build on Linux: add --index-url "
                           "https://download.pytorch.org/whl/cpu, or see notebooks/WORKSHOP_KIT.md)"),
    "transformers": ("5.0", "6", "pip install \"transformers>=5.0,<6\""),
}
LAB = {
    "jupyterlab": ("4", None, "pip install \"cbteach[lab]\" (or, in a clone: pip install -e \".[lab]\")"),
    "ipywidgets": ("8", None, "pip install \"cbteach[lab]\" (or, in a clone: pip install -e \".[lab]\")"),
}
PROMPTS = ("Abdication", "Love", "Patience", "Zeal")  # four headwords of bierce's dictionary
NEW_TOKENS = 12
SLOTS = 2


@dataclass
class Check:
    """One check's outcome: ``ok``; ``detail`` says what was found; ``fix`` how to mend a failure."""

    name: str
    ok: bool
    detail: str
    fix: str = ""

    def line(self) -> str:
        return f"[{'ok' if self.ok else 'FAIL'}] {self.name}: {self.detail}"


def _release(text: str) -> tuple:
    """A version string's release numbers (``"2.13.0+cpu"`` -> ``(2, 13, 0)``), for comparisons."""
    try:
        from packaging.version import Version
    except ImportError:  # packaging comes with transformers; without it, the leading numbers will do
        found = re.match(r"\d+(\.\d+)*", text)
        if found is None:
            raise ValueError(f"no version number in {text!r}") from None
        return tuple(int(x) for x in found.group(0).split("."))
    return Version(text).release


def check_python(version_info=None) -> Check:
    """Python 3.10 or newer (``requires-python`` in pyproject.toml)."""
    v = tuple(version_info or sys.version_info)[:3]
    text = ".".join(str(x) for x in v)
    if v[:2] >= MIN_PYTHON:
        return Check("python", True, text)
    need = ".".join(map(str, MIN_PYTHON))
    return Check("python", False, f"{text} is older than {need}",
                 f"install Python {need} or newer (3.12, say: notebooks/WORKSHOP_KIT.md) and make a new "
                 "virtual environment with it")


def check_package(dist: str, lowest: str, below: str | None, fix: str, version_of=None) -> Check:
    """``dist`` installed at a version in ``[lowest, below)``; ``version_of`` stands in for
    :func:`importlib.metadata.version` in tests."""
    version_of = version_of or importlib.metadata.version
    try:
        found = version_of(dist)
    except importlib.metadata.PackageNotFoundError:
        return Check(dist, False, "not installed", fix)
    allowed = f">={lowest}" + (f",<{below}" if below else "")
    try:
        release = _release(found)
    except Exception:  # noqa: BLE001 -- a version string packaging cannot read: say so, do not guess
        return Check(dist, False, f"version {found!r} cannot be read; cbteach needs {allowed}", fix)
    if release < _release(lowest) or (below and release >= _release(below)):
        return Check(dist, False, f"{found} is installed; cbteach needs {allowed}", fix)
    return Check(dist, True, found)


def in_colab() -> bool:
    """Running inside Google Colab (which serves notebooks itself: JupyterLab is not needed there)."""
    if "google.colab" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("google.colab") is not None
    except ImportError:  # no ``google`` package at all
        return False


def check_engine(device: str = "auto") -> tuple[list[Check], str | None]:
    """Load the embedded model offline and run the tiny engines against ``model.generate``; returns the
    checks and the device the model ran on (None when it did not load)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the embedded model needs nothing from the network
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    from .models import device_option, load_model

    try:
        dev = device_option(device)
    except ValueError as err:
        return [Check("device", False, str(err).split(";")[0],
                      "use --device auto (the best this machine has), cpu, cuda or mps")], None
    try:
        model, tok = load_model("bierce", device=dev)
    except Exception as err:  # noqa: BLE001 -- anything here is the answer to "is this machine ready?"
        return [Check("model", False, f"the embedded model did not load: {type(err).__name__}: {err}",
                      "reinstall cbteach (pip install --force-reinstall --no-deps cbteach, or in a clone: "
                      "pip install -e .) and run this again")], None
    used = str(next(model.parameters()).device)
    checks = [Check("model", True, f"bierce loaded offline, fp32, on {used}")]
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    expected = []
    try:
        for ids in prompts:
            x = torch.tensor([ids], device=model.device)
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=[], pad_token_id=0)
            expected.append(out[0, len(ids):].tolist())
    except Exception as err:  # noqa: BLE001
        return checks + [Check("model.generate", False, f"raised {type(err).__name__}: {err}", _engine_fix(used))], used
    from .core.request import Request
    from .engine.engine import Engine

    for kv in ("concat", "paged"):
        try:
            with Engine(model, tok, max_batch_size=SLOTS, kv=kv) as engine:
                done = engine.run([Request(ids, NEW_TOKENS, request_id=f"p{i}", ignore_eos=True)
                                   for i, ids in enumerate(prompts)])
            same = sum(c.output_ids == e for c, e in zip(done, expected))
        except Exception as err:  # noqa: BLE001
            checks.append(Check(f"engine ({kv} KV cache)", False, f"raised {type(err).__name__}: {err}",
                                _engine_fix(used)))
            continue
        detail = (f"{same}/{len(prompts)} requests equal to per-prompt model.generate, token for token "
                  f"({NEW_TOKENS} greedy tokens each, {SLOTS} slots, on {used})")
        checks.append(Check(f"engine ({kv} KV cache)", same == len(prompts), detail,
                            "" if same == len(prompts) else _engine_fix(used)))
    return checks, used


def _engine_fix(device: str) -> str:
    if device.startswith("cpu"):
        return ("this should not happen on a CPU: run `python -m pytest tests/test_engine_equality.py` in a clone and "
                "file an issue with its output")
    return (f"the engine is not exact on {device}: use a CPU runtime (on Colab: Runtime > Change runtime type > "
            "CPU) or run this with --device cpu, and tell the instructor")


def run_checks(device: str = "auto", lab: bool | None = None, say=print) -> list[Check]:
    """Every check in order, each printed as it finishes; ``lab=None``: JupyterLab is checked unless in Colab."""
    try:
        version = importlib.metadata.version("cbteach")
    except importlib.metadata.PackageNotFoundError:  # a checkout on the path, not installed
        version = "(not installed)"
    say(f"cbteach {version} from {os.path.dirname(os.path.abspath(__file__))}")
    checks = [check_python()]
    say(checks[-1].line())
    if lab is None:
        lab = not in_colab()
    wanted = dict(CORE, **(LAB if lab else {}))
    for dist, (lowest, below, fix) in wanted.items():
        checks.append(check_package(dist, lowest, below, fix))
        say(checks[-1].line())
    if not all(c.ok for c in checks if c.name in ("python", *CORE)):
        skipped = Check("engine", False, "not run: it needs the Python and packages above",
                        "fix the lines marked FAIL above, then run this again")
        say(skipped.line())
        return checks + [skipped]
    engine_checks, used = check_engine(device)
    for c in engine_checks:
        say(c.line())
    if used is not None:
        say(f"device: {used} (the device the model ran on)")
    return checks + engine_checks


def verdict(checks: list[Check]) -> str:
    """The final line: ``ready``, or ``not ready: <what> -- fix: <how>`` for each failed check."""
    failed = [c for c in checks if not c.ok]
    if not failed:
        return "ready"
    return "not ready: " + "; ".join(f"{c.name}: {c.detail} -- fix: {c.fix}" for c in failed)


def cli(argv=None) -> int:
    """``python -m cbteach preflight [--device D] [--no-lab]``: 0 when ready, 1 when not."""
    p = argparse.ArgumentParser(prog="python -m cbteach preflight", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (the best this machine has), cpu, cuda or mps")
    p.add_argument("--no-lab", action="store_true",
                   help="do not check JupyterLab and ipywidgets (Colab, or a machine using another front end)")
    a = p.parse_args(argv)
    checks = run_checks(a.device, lab=False if a.no_lab else None)
    print(verdict(checks))
    return 0 if all(c.ok for c in checks) else 1
