"""Loading models: the embedded "bierce" model from the package, or any causal LM from the hub.

``load_model()`` with no arguments never touches the network: bierce's weights, config and
tokenizer ship inside the package (``cbteach/bierce/``), and so does its small draft model for
speculative decoding, ``load_model("bierce-draft")`` (``cbteach/bierce/draft/``, trained by the
same script on the same tokenizer). Any other name is a Hugging Face hub id
for online users; offline, an uncached id fails with one clear error naming the embedded default.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

import torch

BIERCE_DIR = Path(__file__).parent / "bierce"
DEFAULT_MODEL = "bierce"
DRAFT_MODEL = "bierce-draft"  # bierce's speculative-decoding draft: same tokenizer, a fifth of the size
EMBEDDED = {DEFAULT_MODEL: BIERCE_DIR, DRAFT_MODEL: BIERCE_DIR / "draft"}


def pick_device(device=None) -> torch.device:
    """``device`` if given (it must exist on this machine), else cuda, then mps, then cpu -- whichever
    this machine has first."""
    if device is not None:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"unknown device {device!r}; use 'cpu', 'cuda', 'mps', or None for the best "
                             "this machine has") from None
        if dev.type not in ("cpu", "cuda", "mps"):  # torch names more (xpu, meta, ...): the course runs on these
            raise ValueError(f"unknown device {device!r}; use 'cpu', 'cuda', 'mps', or None for the best "
                             "this machine has")
        mps = getattr(torch.backends, "mps", None)
        if (dev.type == "cuda" and not torch.cuda.is_available()) or \
                (dev.type == "mps" and not (mps is not None and mps.is_available())):
            raise ValueError(f"device {device!r} is not available on this machine (torch {torch.__version__}); "
                             "use 'cpu', or None for the best this machine has")
        if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} is not available on this machine ({torch.cuda.device_count()} "
                             "CUDA devices); use 'cuda' for the first, or None for the best this machine has")
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def device_option(text: str) -> torch.device:
    """The command line's ``--device``: ``auto`` (the best this machine has), ``cpu``, ``cuda``,
    ``cuda:1``, ``mps``. Raises ValueError in the option's own words (``auto``, not None)."""
    if text == "auto":
        return pick_device(None)
    try:
        return pick_device(text)
    except ValueError as err:
        what = f"device {text!r} is not available on this machine" if "not available" in str(err) \
            else f"unknown device {text!r}"
        raise ValueError(f"{what}; use --device cpu, cuda, mps, or auto (the best this machine has)") from None


def hub_reachable(timeout: float = 3.0) -> bool:
    """Can the Hugging Face hub be reached at all? False at once when ``HF_HUB_OFFLINE`` is set, and
    within ``timeout`` seconds when the network is down (instead of the hub client's retries)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    parts = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((parts.hostname, parts.port or 443), timeout=timeout):
            return True
    except (OSError, TypeError):
        return False


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def pick_dtype(device: torch.device, dtype=None) -> torch.dtype:
    """``dtype`` if given, else fp32 -- on every device.

    The course's promise is that batching changes nothing: every strategy gives token for token
    what ``model.generate`` gives one prompt at a time. That holds in fp32. In bf16 or fp16 the
    *shape* of a batch changes the order of floating-point reductions, and with it the last bits of
    the logits, so two greedy runs can part ways at a near-tie (notebook 01 shows it). Low precision
    is therefore an explicit choice: ``load_model(dtype="bfloat16")``.
    """
    if dtype is not None:
        given = dtype
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None)
        if dtype not in FLOAT_DTYPES:  # (int8 weights are not a dtype to load: the int8 KV cache is an engine option)
            raise ValueError(f"dtype must be one of {', '.join(str(d).removeprefix('torch.') for d in FLOAT_DTYPES)} "
                             f"(a torch.dtype or its name), got {given!r}")
        return dtype
    return torch.float32


def load_model(name: str = DEFAULT_MODEL, device=None, dtype=None):
    """Return ``(model, tokenizer)``, the model in eval mode on ``device`` in ``dtype``.

    ``name="bierce"`` loads the embedded model and ``"bierce-draft"`` its draft model (with
    bierce's tokenizer); anything else is passed to transformers' ``AutoModelForCausalLM`` /
    ``AutoTokenizer`` as a hub id or a local directory.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not isinstance(name, str) or not name:
        raise ValueError(f"model name must be a non-empty string such as {DEFAULT_MODEL!r} or 'gpt2'")
    dev = pick_device(device)
    dt = pick_dtype(dev, dtype)
    if name.startswith("~"):  # a folder under the home directory, as a shell would read it
        name = str(Path(name).expanduser())
    source = EMBEDDED.get(name, name)
    tokenizer_source = BIERCE_DIR if name in EMBEDDED else name
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a 2M-parameter model loads in an instant; no bar needed
    # A hub id that is not cached: find out in seconds whether the hub is there at all, instead of
    # waiting out the hub client's retries (about a minute) before the same error.
    local = name in EMBEDDED or Path(name).is_dir()
    online = local or hub_reachable()
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, local_files_only=not online)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dt, local_files_only=not online)
    except (OSError, ValueError) as err:
        if name in EMBEDDED:
            raise
        use = (f"load_model({DEFAULT_MODEL!r}) (on the command line: --model {DEFAULT_MODEL})")
        cause = f"Cause: {type(err).__name__}: {str(err).splitlines()[0]}"
        path = Path(name)
        if path.is_file():
            raise ValueError(f"could not load model {name!r}: it is a file, not a model folder (a folder with "
                             f"config.json and the weights). The course runs offline on the embedded model: "
                             f"use {use}. {cause}") from None
        if path.is_dir() or name.startswith(("/", "./", "../", "~")):
            raise ValueError(f"could not load model {name!r}: {'the folder holds no model' if path.is_dir() else 'no such folder'}"
                             f". The course runs offline on the embedded model: use {use}. {cause}") from None
        raise ValueError(
            f"could not load model {name!r}: it is not a local directory and not in the Hugging Face cache, "
            f"and the hub could not be reached (offline?). The course runs offline on the embedded model: "
            f"use {use}. {cause}"
        ) from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return model.to(dev).eval(), tokenizer
