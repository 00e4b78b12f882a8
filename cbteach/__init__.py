"""cbteach: learn continuous batching for LLM inference by running a real, small engine.

The pieces, in the order the course meets them:

* :func:`load_model` -- the embedded "bierce" model (or any hub model when online);
* :func:`static_batching` -- the baseline: padded waves behind a batch barrier;
* :class:`Engine` -- continuous batching: iteration-level scheduling, ragged packing with
  block-diagonal causal masks, and a KV cache that is either concatenated (``kv="concat"``)
  or paged (``kv="paged"``);
* :class:`Request` in, :class:`Completion` out, a :class:`StepRecord` for every step;
* the scheduler's policies (:mod:`cbteach.engine.policies`), serving metrics (:mod:`cbteach.serving.metrics`),
  and beyond the basics: prefix caching, speculative decoding, an int8 KV pool and a simulated
  prefill/decode disaggregation (:mod:`cbteach.serving.disagg`) -- all options of the same engine.
"""
from importlib import import_module

from .attention.triton_mode import interpret_without_gpu

interpret_without_gpu()  # before anything imports Triton: its interpreter where no GPU is (see the module)

# The names below are imported when first used (PEP 562), not here: ``import cbteach`` stays quick, and
# ``cbteach serve`` installs its signal handlers before torch and transformers load (seconds).
_WHERE = {"Engine": ".engine.engine", "load_model": ".models", "SeqStep": ".core.records",
          "StepRecord": ".core.records", "Completion": ".core.request", "Request": ".core.request",
          "RequestStatus": ".core.request", "SamplingParams": ".core.sampling", "StaticResult": ".engine.static",
          "static_batching": ".engine.static", "StreamEvent": ".engine.streaming"}
__all__ = ["Engine", "Request", "Completion", "RequestStatus", "SamplingParams", "StepRecord", "SeqStep",
           "StreamEvent", "load_model", "static_batching", "StaticResult"]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'cbteach' has no attribute {name!r}")
    value = getattr(import_module(_WHERE[name], __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


__version__ = "0.1.0"
# The one place the repository URL lives; every notebook's Colab install cell must match it
# (tests/test_notebooks.py checks).
REPO_URL = "https://github.com/cbteach/cbteach"
