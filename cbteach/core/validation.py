"""The checks that keep bad input away from the engine: a request is validated when it is *added*.

Validation happens when a request is added (:func:`validate_request`), never mid-run, so a bad request
is refused with a ``ValueError`` -- saying what is wrong and what is allowed -- before it can disturb
the requests already running.
"""
from __future__ import annotations

import math
import numbers

from .request import Request
from .sampling import SamplingParams

# Arrival times are seconds on the engine's clock; 10**8 s is over three years. A larger value is a
# clock reading such as time.time() (about 1.8e9 today), which would make run() sleep for decades.
ABSOLUTE_TIME = 1e8


def check_positive_int(name: str, value) -> None:
    """Raise ``ValueError`` unless ``value`` is an integer >= 1 (``True`` is not a size)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def as_request_list(requests, where: str) -> list:
    """``requests`` as a list, or a ``ValueError`` that says what ``where`` takes (the items themselves
    are checked one by one by :func:`validate_request`)."""
    if isinstance(requests, Request):
        raise ValueError(f"{where} takes a list of Requests; for one request pass [request]")
    if isinstance(requests, (str, bytes, dict)) or not hasattr(requests, "__iter__"):  # (a dict: its keys)
        more = "; for a dict of them pass list(d.values())" if isinstance(requests, dict) else ""
        raise ValueError(f"{where} takes a list of Requests, got {type(requests).__name__}{more}")
    return list(requests)


def validate_request(request, *, tokenizer, vocab_size: int, max_pos: int | None) -> list[int]:
    """Check a request and return its prompt as token ids; raise ``ValueError`` saying what is wrong.

    Checked: the prompt's type, that it is not empty, that its ids and its ``stop_token_ids`` are
    inside the vocabulary, that ``max_new_tokens`` is an integer >= 1, and that prompt +
    ``max_new_tokens`` fits in the model's positions.
    """
    if not isinstance(request, Request):
        raise ValueError(f"expected a cbteach.Request, got {type(request).__name__}")
    rid = request.request_id
    try:
        hash(rid)
    except TypeError:
        raise ValueError(f"request_id must be hashable (a str or an int, say), got {type(rid).__name__}") from None
    at = request.arrival_time
    if at is not None and (not isinstance(at, numbers.Real) or isinstance(at, bool) or not math.isfinite(at)
                           or at < 0):
        raise ValueError(f"request {rid!r}: arrival_time must be None (now) or a finite number of seconds >= 0, "
                         f"got {at!r}")
    if at is not None and at >= ABSOLUTE_TIME:
        raise ValueError(f"request {rid!r}: arrival_time={at!r} looks like an absolute clock time (time.time()); "
                         "arrival_time counts seconds after the engine starts (add_request) or after run() is "
                         "called -- pass None for 'now', or time.time() - your start time")
    if not isinstance(request.sampling_params, SamplingParams):
        raise ValueError(f"request {rid!r}: sampling_params must be a cbteach.SamplingParams, "
                         f"got {type(request.sampling_params).__name__}")
    if not isinstance(request.ignore_eos, bool):
        raise ValueError(f"request {rid!r}: ignore_eos must be True or False, got {request.ignore_eos!r}")
    if not isinstance(request.priority, numbers.Integral) or isinstance(request.priority, bool):
        raise ValueError(f"request {rid!r}: priority must be an int (smaller = more urgent), got {request.priority!r}")
    prompt = request.prompt
    if isinstance(prompt, (bytes, bytearray, dict, set, frozenset)):  # bytes are not ids; a set has no order
        raise ValueError(f"request {rid!r}: prompt must be a str or a list of token ids, "
                         f"not {type(prompt).__name__}")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"request {rid!r}: a text prompt needs a tokenizer; pass one to the engine "
                             "or give the prompt as a list of token ids")
        if not callable(tokenizer):
            raise ValueError(f"request {rid!r}: a text prompt needs a tokenizer that can be called on text "
                             f"(a transformers tokenizer); the engine's is a {type(tokenizer).__name__}")
        try:
            ids = list(tokenizer(prompt)["input_ids"])
        except Exception as err:  # noqa: BLE001  (the tokenizer failed on this text: this request is refused, whole)
            raise ValueError(f"request {rid!r}: the tokenizer could not encode the prompt ({type(err).__name__}: "
                             f"{err}); the engine's tokenizer is called as tokenizer(text)['input_ids'], as a "
                             "transformers tokenizer is") from err
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"request {rid!r}: the tokenizer gave {str(ids)[:80]} for the prompt, not a flat list of "
                             "token ids; the engine's tokenizer must turn one text into one list of ints")
    else:
        try:
            ids = list(prompt.tolist() if hasattr(prompt, "tolist") else prompt)
        except TypeError:
            raise ValueError(f"request {rid!r}: prompt must be a str or a list of token ids, "
                             f"got {type(prompt).__name__}") from None
        if ids and all(isinstance(t, (list, tuple)) for t in ids):  # [[5, 6, 7]]: a batch of prompts (input_ids)
            raise ValueError(f"request {rid!r}: the prompt is a batch of {len(ids)} prompt(s), shaped like a "
                             "tokenizer's input_ids [batch, tokens]; a Request takes one prompt's ids, a flat list "
                             "(input_ids[0]), or one Request per prompt")
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"request {rid!r}: prompt token ids must be ints, got {str(ids)[:80]}")
        ids = [int(t) for t in ids]  # numpy or torch integers become plain ints
    if not ids:
        raise ValueError(f"request {rid!r}: the prompt is empty; give at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"request {rid!r}: token id {bad[0]} is outside the vocabulary; "
                         f"ids must be in [0, {vocab_size})")
    stops = [t for t in request.sampling_params.stop_token_ids if not 0 <= t < vocab_size]
    if stops:
        raise ValueError(f"request {rid!r}: stop token id {stops[0]} is outside the vocabulary and could never be "
                         f"sampled; ids must be in [0, {vocab_size})")
    mnt = request.max_new_tokens
    if not isinstance(mnt, numbers.Integral) or isinstance(mnt, bool) or mnt < 1:
        raise ValueError(f"request {rid!r}: max_new_tokens must be an integer >= 1, got {mnt!r}")
    if max_pos is not None and len(ids) + mnt > max_pos:
        raise ValueError(f"request {rid!r}: prompt ({len(ids)} tokens) + max_new_tokens ({mnt}) = "
                         f"{len(ids) + mnt} exceeds the model's {max_pos} positions")
    return ids
