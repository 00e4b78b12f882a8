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
from .attention.triton_mode import interpret_without_gpu

interpret_without_gpu()  # before anything imports Triton: its interpreter where no GPU is (see the module)

from .engine.engine import Engine  # noqa: E402
from .models import load_model  # noqa: E402
from .core.records import SeqStep, StepRecord  # noqa: E402
from .core.request import Completion, Request, RequestStatus  # noqa: E402
from .core.sampling import SamplingParams  # noqa: E402
from .engine.static import StaticResult, static_batching  # noqa: E402
from .engine.streaming import StreamEvent  # noqa: E402

__all__ = ["Engine", "Request", "Completion", "RequestStatus", "SamplingParams", "StepRecord", "SeqStep",
           "StreamEvent", "load_model", "static_batching", "StaticResult"]
__version__ = "0.1.0"
# The one place the repository URL lives; every notebook's Colab install cell must match it
# (tests/test_notebooks.py checks).
REPO_URL = "https://github.com/cbteach/cbteach"
