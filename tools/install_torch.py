#!/usr/bin/env python
"""Install torch's CPU build into the running Python before cbteach (``make`` calls this first).

Why a step of its own: on Linux, a plain ``pip install torch`` (or a ``torch`` requirement pulled
in by cbteach) resolves to the CUDA build -- a ~530 MB wheel plus several GB of CUDA libraries.
The course runs on a CPU, so:

1. a torch >= 2.6 that is already installed (CPU or CUDA) is kept;
2. else on Linux, if PyTorch's CPU wheel index answers within a few seconds, torch comes from there
   (``pip install "torch>=2.6" --index-url https://download.pytorch.org/whl/cpu``);
3. else the pinned fallback (``--fallback``, default ``torch==2.13.0``) is installed from the
   ordinary index: a CPU build on machines that carry it locally, and on macOS and Windows, where
   PyPI's torch is the CPU build anyway.

``--index-url`` and ``--fallback`` override the two sources (``make TORCH_INDEX=... TORCH=...``).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import urllib.error
import urllib.request

MIN_TORCH = (2, 6)
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def installed_torch() -> str | None:
    """The installed torch's version if it is recent enough, else None (none, or too old)."""
    try:
        import torch
    except ImportError:
        return None
    parts = torch.__version__.split("+")[0].split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        return None
    return torch.__version__ if (major, minor) >= MIN_TORCH else None


def reachable(url: str, timeout: float = 5.0) -> bool:
    """Does ``url`` answer at all within ``timeout`` seconds? (No answer: offline or blocked.)"""
    try:
        urllib.request.urlopen(urllib.request.Request(url.rstrip("/") + "/torch/", method="HEAD"), timeout=timeout)
        return True
    except urllib.error.HTTPError:
        return True  # it answered, even if not 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index-url", default=CPU_INDEX, help="PyTorch's CPU wheel index (default: %(default)s)")
    p.add_argument("--fallback", default="torch==2.13.0",
                   help="what to install when that index is unreachable (default: %(default)s)")
    a = p.parse_args(argv)
    have = installed_torch()
    if have:
        print(f"install_torch: keeping the installed torch {have}")
        return 0
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    if sys.platform.startswith("linux") and reachable(a.index_url):
        print(f"install_torch: torch's CPU build from {a.index_url}")
        cmd = pip + [f"torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}", "--index-url", a.index_url]
    else:
        why = "" if sys.platform.startswith("linux") else f" ({sys.platform}: PyPI's torch is the CPU build)"
        print(f"install_torch: {a.index_url} not used{why or ' (unreachable)'}; installing {a.fallback}")
        cmd = pip + a.fallback.split()
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
