"""Triton's interpreter where there is no GPU -- switched on before anything imports Triton.

Triton runs kernels one way for the whole process: compiled for a GPU, or interpreted
(``TRITON_INTERPRET=1``: NumPy runs each program in turn, on CPU tensors -- slow, exact, on any
laptop). It reads the switch when it is imported: ``triton.language``'s own helpers (``tl.max``,
``tl.sum``, ``tl.zeros``) are kernels decorated at that moment, and a process cannot mix the two
ways. transformers imports Triton as soon as a model class is imported (through ``torch._dynamo``),
so ``import cbteach`` calls :func:`interpret_without_gpu` first thing. It sets the switch only where
nothing else can notice: Triton installed but not yet imported, the variable unset, and no CUDA
device -- without one Triton cannot compile a kernel at all.
"""
from __future__ import annotations

import importlib.util
import os
import sys

VARIABLE = "TRITON_INTERPRET"


def interpret_without_gpu() -> bool:
    """Set ``TRITON_INTERPRET=1`` if Triton is installed and not yet imported, the variable is unset and
    no CUDA device is visible. Returns whether it did."""
    if VARIABLE in os.environ or "triton" in sys.modules or importlib.util.find_spec("triton") is None:
        return False
    if not no_gpu_possible():  # there may be one: ask torch (an import of a few seconds)
        import torch

        if torch.cuda.is_available():
            return False
    os.environ[VARIABLE] = "1"
    return True


def no_gpu_possible() -> bool:
    """True where no GPU Triton could compile for can exist, known without importing torch: macOS, or a
    Linux with none of the device files a CUDA (``/dev/nvidiactl``), ROCm (``/dev/kfd``) or WSL
    (``/dev/dxg``) GPU needs. Anywhere else: False -- then torch is asked. (``import cbteach`` stays
    quick on a laptop, so ``cbteach serve`` has its signal handlers before the heavy imports start.)"""
    if sys.platform == "darwin":
        return True
    if sys.platform.startswith("linux"):
        return not any(os.path.exists(f) for f in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg"))
    return False


def available() -> bool:
    """Whether Triton can be imported here (Linux wheels; Colab has it)."""
    return importlib.util.find_spec("triton") is not None


def describe() -> str:
    """One line: how this process runs Triton kernels, if at all."""
    if not available():
        return 'Triton is not installed: the kernel cells skip (pip install "cbteach[kernels]")'
    from . import triton_unified

    return ("Triton runs kernels in its interpreter, on CPU tensors (no GPU here)" if triton_unified.INTERPRETED
            else "Triton compiles kernels for the GPU")


class _StandIn:
    """Where Triton is missing: ``@triton.jit`` leaves a function as it is and ``tl.constexpr`` is a
    plain annotation, so a notebook cell that defines a kernel still runs (and its check says why not)."""

    constexpr = object

    @staticmethod
    def jit(fn=None, **_):
        return fn if fn is not None else (lambda f: f)


def __getattr__(name):
    """``from cbteach.attention.triton_mode import triton, tl``: the real modules, imported only now (after
    :func:`interpret_without_gpu` ran), or stand-ins where Triton is not installed."""
    if name not in ("triton", "tl"):
        raise AttributeError(name)
    if not available():
        return _StandIn
    import triton
    import triton.language

    return triton if name == "triton" else triton.language
