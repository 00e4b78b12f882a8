"""The OpenAI wire format, checked at the door: request bodies in, response and chunk bodies out.

A serving engine is only as robust as the layer that reads what clients send. Every field of a
``/v1/completions`` or ``/v1/chat/completions`` body is checked here, before anything reaches the
engine, and a bad one becomes an :class:`APIError` -- a 4xx with OpenAI's error body
``{"error": {"message", "type", "param", "code"}}`` that names the field. The prompt's checks
(its length before it is tokenized, ids in the vocabulary, prompt + ``max_tokens`` within the
model's positions: :mod:`.tokenization`) and the engine core's own (a request that could never fit
the KV pool) come next, and are reported the same way.

Defaults follow the model, as vLLM's ``--generation-config auto`` does: without ``temperature`` a
request decodes the way the model's generation config says ``generate`` would (bierce's: greedy), so
a plain client gets exactly ``model.generate``'s answer. ``max_tokens`` is required unless the server
was started with ``--default-max-tokens``: a chat server that silently generates up to the model's
4,096 positions is a way to hold a batch slot for a minute.

**The plain-text chat template.** bierce (like GPT-2) has no chat template, so a chat request is
turned into one prompt by joining every message's text with a blank line, in order, and the model
continues after the last one -- no role labels, because the model never saw any: a user message
``"CYNIC, n."`` gets the definition the model would write after that headword. A tokenizer that has a
chat template uses it (``apply_chat_template(..., add_generation_prompt=True)``).

Extensions that vLLM also accepts: ``ignore_eos`` (benchmarks need fixed lengths),
``return_token_ids`` (each choice then carries its ``token_ids``, so a client can check tokens, not
just text), ``priority`` (smaller is more urgent; ``serve --policy priority`` reads it) and
``stop_token_ids`` (more ids that end the answer; as in vLLM the stop token counts in ``usage`` and
its text is left out). A field that would change the answer and is not implemented
(``logprobs``, penalties, vLLM's ``top_k``...) is refused, not ignored; so is a field this server does
not know (OpenAI's API does the same: a misspelt ``max_token`` must not pass as a default).
"""
from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass

from ..core.sampling import SamplingParams

ROLES = ("system", "developer", "user", "assistant")
MESSAGE_KEYS = ("role", "content", "name")  # what a chat message may hold (the tokenizer's chat template sees all three)
MAX_STOP = 4  # OpenAI allows up to four stop sequences
MAX_STOP_TOKEN_IDS = 64
MAX_PRIORITY = 2**31 - 1  # a request's priority, bounded to an int32 (every real priority fits)
# Fields that would change the answer, with the values that leave it as it is (the only ones taken). vLLM's
# own sampling extensions are here too: a client that sends top_k=50 must not get a greedy answer silently.
# (logprobs 0 is not among them: it asks for the chosen token's logprob)
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
               "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
               "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"), "response_format": (None,),
               "functions": (None, []), "function_call": (None, "none"), "audio": (None,), "prediction": (None,),
               "top_k": (None, -1, 0), "min_p": (None, 0), "min_tokens": (None, 0), "repetition_penalty": (None, 1),
               "use_beam_search": (None, False), "include_stop_str_in_output": (None, False),
               "skip_special_tokens": (None, True), "logprobs_mode": (None,), "prompt_logprobs": (None,)}
# Fields taken that change nothing here (OpenAI's bookkeeping; each with the type it must have, and how an error
# names it), and the fields each endpoint reads.
IGNORED = {"user": (str, "a string (an id for your end user)"), "store": (bool, "true or false"),
           "metadata": (dict, "an object whose keys and values are strings"), "service_tier": (str, 'a string such as "auto"'),
           "parallel_tool_calls": (bool, "true or false"),
           "modalities": (list, 'a list of output kinds; this server answers ["text"]')}
COMMON = ("model", "n", "stop", "stream", "stream_options", "temperature", "top_p", "seed", "ignore_eos", "priority",
          "return_token_ids", "stop_token_ids", "cbteach_fail_after", *IGNORED, *UNSUPPORTED)
KNOWN = {"completion": frozenset(("prompt", "max_tokens", *COMMON)),
         "chat": frozenset(("messages", "max_tokens", "max_completion_tokens", *COMMON))}


class APIError(Exception):
    """A request the server refuses: HTTP ``status`` and OpenAI's error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after  # seconds, for a Retry-After header (a 503 the client may retry)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass(frozen=True)
class Limits:
    """What one request may ask of this server (the per-request caps)."""

    served_model: str
    max_tokens_cap: int  # the largest max_tokens accepted
    max_n: int = 8  # choices per request (n), and prompts x n for a batched completion
    default_max_tokens: int | None = None  # None: max_tokens is required
    default_temperature: float = 0.0  # from the model's generation config
    vocab_size: int | None = None  # token ids (stop_token_ids) must be below it


@dataclass(frozen=True)
class GenerationRequest:
    """A checked request: one or more prompts, each sampled ``n`` times with the same settings."""

    kind: str  # "completion" or "chat"
    prompts: tuple  # str (text) or tuple of token ids, one per prompt
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    n: int
    stop: tuple
    stop_token_ids: tuple
    stream: bool
    include_usage: bool
    ignore_eos: bool
    return_token_ids: bool
    model: str
    priority: int = 0  # smaller = more urgent (serve --policy priority reads it; fcfs orders by arrival)

    def choices(self):
        """``(index, prompt, SamplingParams)`` per choice; a seeded request gives choice ``i`` the seed ``seed + i``
        so the ``n`` choices differ but each is reproducible."""
        i = 0
        for prompt in self.prompts:
            for k in range(self.n):
                seed = None if self.seed is None else self.seed + k
                yield i, prompt, SamplingParams(self.temperature, self.top_p, seed,
                                                stop_token_ids=self.stop_token_ids)
                i += 1


# -- reading fields ---------------------------------------------------------------------------------
def _int(body: dict, name: str, default, low: int, high: int | None = None):
    v = body.get(name)
    if v is None:  # missing or null: the server's default (checked when the server started)
        return default
    if not isinstance(v, numbers.Integral) or isinstance(v, bool):
        raise bad(f"'{name}' must be an integer, got {type(v).__name__} {v!r}", name)
    if v < low or (high is not None and v > high):
        raise bad(f"'{name}' must be between {low} and {high}, got {v}" if high is not None
                  else f"'{name}' must be >= {low}, got {v}", name)
    return int(v)


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, numbers.Real) or isinstance(v, bool) or (not isinstance(v, int) and not math.isfinite(v)):
        raise bad(f"'{name}' must be a number, got {type(v).__name__} {v!r}"[:300], name)
    if v > high or v < low or (low_open and v == low):  # (an int past float's range compares exactly too)
        raise bad(f"'{name}' must be in {'(' if low_open else '['}{low:g}, {high:g}], got {v!r}"[:300], name)
    return float(v)


def _bool(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be true or false, got {v!r}", name)
    return v


def _stop(body: dict) -> tuple:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise bad(f"'stop' must be a non-empty string or a list of at most {MAX_STOP} non-empty strings", "stop")
    return tuple(stops)


def _stop_token_ids(body: dict, vocab_size: int | None) -> tuple:
    v = body.get("stop_token_ids")
    if v is None:
        return ()
    top = vocab_size if vocab_size is not None else 2**31
    if (not isinstance(v, list) or len(v) > MAX_STOP_TOKEN_IDS
            or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and 0 <= t < top for t in v)):
        raise bad(f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} token ids (integers from 0 to "
                  f"{top - 1}), got {v!r}"[:300], "stop_token_ids")
    return tuple(int(t) for t in v)


def _same(v, allowed: tuple) -> bool:
    """``v`` is one of ``allowed`` -- as JSON means it: ``true`` is not ``1``."""
    return any(v == a and isinstance(v, bool) == isinstance(a, bool) for a in allowed)


def _check_fields(body: dict, kind: str) -> None:
    unknown = sorted(k for k in body if k not in KNOWN[kind])
    if unknown:
        raise bad(f"unknown field(s) {', '.join(map(repr, unknown))}"[:300] + f"; this endpoint takes: "
                  f"{', '.join(sorted(KNOWN[kind] - set(UNSUPPORTED) - {'cbteach_fail_after'}))}", unknown[0],
                  "unknown_parameter")
    for name, allowed in UNSUPPORTED.items():
        if name in body and not _same(body[name], allowed):
            raise bad(f"'{name}' is not supported by cbteach's server (it would change the answer); leave it out",
                      name, "unsupported_parameter")


def _common(body, limits: Limits, kind: str, prompts: tuple, max_tokens_names: tuple) -> GenerationRequest:
    model = body.get("model")
    model = limits.served_model if model is None else model  # (null: the default, as for every other field)
    if not isinstance(model, str):
        raise bad(f"'model' must be a string, got {type(model).__name__}", "model")
    if model != limits.served_model:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{limits.served_model}' "
                            "(GET /v1/models)", param="model", code="model_not_found")
    _check_fields(body, kind)
    for other in max_tokens_names[1:]:  # chat: max_tokens is deprecated for max_completion_tokens; both are checked
        given = _int(body, other, None, 1, limits.max_tokens_cap)
        first = _int(body, max_tokens_names[0], None, 1, limits.max_tokens_cap)
        if given is not None and first is not None and first != given:
            raise bad(f"'{max_tokens_names[0]}' is {first} and '{other}' is {given}: they say the same thing "
                      f"({other} is its older name), so give one, or both equal", max_tokens_names[0])
    name = next((k for k in max_tokens_names if body.get(k) is not None), max_tokens_names[0])
    max_tokens = _int(body, name, limits.default_max_tokens, 1, limits.max_tokens_cap)
    if max_tokens is None:
        raise bad(f"'{name}' is required: how many tokens may the answer have (1 to {limits.max_tokens_cap})?", name)
    n = _int(body, "n", 1, 1, limits.max_n)
    if n * len(prompts) > limits.max_n:
        raise bad(f"{len(prompts)} prompts x n={n} choices is more than this server's {limits.max_n} per request",
                  "n" if n > 1 else "prompt")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise bad("'stream_options' must be an object, and only goes with \"stream\": true", "stream_options")
    unknown = sorted(k for k in options or {} if k != "include_usage")
    if unknown:
        raise bad(f"unknown key(s) {', '.join(map(repr, unknown))}"[:200] + " in 'stream_options'; it takes "
                  "'include_usage' only", "stream_options", "unknown_parameter")
    include_usage = (options or {}).get("include_usage", False)
    if include_usage is None:
        include_usage = False
    if not isinstance(include_usage, bool):
        raise bad(f"'stream_options.include_usage' must be true or false, got {include_usage!r}", "stream_options")
    _ignored_fields(body)
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or seed < 0
                             or seed >= 2**63):
        raise bad(f"'seed' must be an integer in [0, 2**63), got {seed!r}", "seed")
    return GenerationRequest(kind, prompts, max_tokens, _number(body, "temperature", limits.default_temperature, 0, 2),
                             _number(body, "top_p", 1.0, 0, 1, low_open=True), seed, n, _stop(body),
                             _stop_token_ids(body, limits.vocab_size), stream,
                             include_usage, _bool(body, "ignore_eos"), _bool(body, "return_token_ids"), model,
                             _int(body, "priority", 0, -MAX_PRIORITY, MAX_PRIORITY))


def _ignored_fields(body: dict) -> None:
    """The bookkeeping fields (:data:`IGNORED`) change nothing, but a value of the wrong type is still a client's
    mistake, named as OpenAI's API would name it."""
    for name, (kind, what) in IGNORED.items():
        v = body.get(name)
        if v is None:
            continue
        ok = isinstance(v, kind) and not (kind is not bool and isinstance(v, bool))
        if name == "metadata" and ok:
            ok = all(isinstance(k, str) and isinstance(x, str) for k, x in v.items())
        if name == "modalities" and ok:
            ok = v == ["text"] or v == []
        if not ok:
            raise bad(f"'{name}' must be {what}, got {json.dumps(v)[:100]}", name)


def check_text(body) -> None:
    """Every string in a parsed body must be text: JSON may spell a lone UTF-16 surrogate (``"\\ud800"``),
    which no tokenizer, and no UTF-8 response that quotes it, can take. The error names the top-level
    field that holds it."""
    if _is_text(body):
        return
    fields = body.items() if isinstance(body, dict) else ()
    param = next((k for k, v in fields if _is_text(k) and not _is_text(v)), None)
    raise bad("the request holds a string that is not valid Unicode text (a lone UTF-16 surrogate such as "
              "\\ud800): send text as UTF-8, or surrogate pairs", param)


def _is_text(value) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_body(body) -> dict:
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _token_ids(p, param: str) -> tuple:
    if not p:
        raise bad("a prompt must not be empty", param)
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in p):
        raise bad("a prompt given as a list must be token ids: integers >= 0", param)
    return tuple(int(t) for t in p)


def parse_completion(body, limits: Limits) -> GenerationRequest:
    """A ``/v1/completions`` body: ``prompt`` is text, token ids, or a list of either (a batch)."""
    body = _check_body(body)
    p = body.get("prompt")
    if isinstance(p, str):
        prompts = (p,)
    elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        prompts = tuple(x if isinstance(x, str) else _token_ids(x, "prompt") for x in p)
    elif isinstance(p, list):
        prompts = (_token_ids(p, "prompt"),)
    else:
        raise bad("'prompt' is required: a string, a list of token ids, or a list of either", "prompt")
    if any(x == "" for x in prompts):
        raise bad("a prompt must not be empty", "prompt")
    return _common(body, limits, "completion", prompts, ("max_tokens",))


def parse_chat(body, limits: Limits, tokenizer) -> GenerationRequest:
    """A ``/v1/chat/completions`` body: ``messages`` rendered to one prompt (see the module's docstring)."""
    body = _check_body(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' is required: a non-empty list of {\"role\", \"content\"} objects", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad(f"messages[{i}] must be an object whose 'role' is one of {', '.join(ROLES)}", "messages")
        other = sorted(k for k, v in m.items() if k not in MESSAGE_KEYS and v not in (None, "", [], {}))
        if other:  # (a client that sends a message back as it came, with "tool_calls": null, still gets in)
            raise bad(f"messages[{i}] has {', '.join(map(repr, other))}"[:200] + ", which this server does not take "
                      f"(it would change the answer); a message takes {', '.join(MESSAGE_KEYS)}", "messages",
                      "unsupported_parameter")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise bad(f"messages[{i}].name must be a string, got {type(name).__name__}", "messages")
        clean.append({"role": m["role"], "content": _content(m.get("content"), i), **({"name": name} if name else {})})
    prompt = render_chat(clean, tokenizer)
    if not prompt:
        raise bad("the messages hold no text", "messages")
    return _common(body, limits, "chat", (prompt,), ("max_completion_tokens", "max_tokens"))


def _content(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)  # (as vLLM joins a message's text parts)
    raise bad(f"messages[{i}].content must be a string or a list of {{\"type\": \"text\", \"text\": ...}} parts "
              "(this server takes text only)", "messages")


def render_chat(messages: list, tokenizer) -> str:
    """One prompt from chat messages: the tokenizer's chat template, or the plain-text template."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n\n".join(m["content"] for m in messages if m["content"])


# -- writing responses -------------------------------------------------------------------------------
# The engine's finish reasons as OpenAI's. A request that was aborted or failed has no finish_reason: it
# is an error (a status, or an error event in a stream: server_app.py), never a 200 that pretends.
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(req: GenerationRequest, index: int, text: str, finish: str | None, token_ids=None) -> dict:
    """One choice of a whole (non-streamed) response."""
    out = {"index": index, "finish_reason": FINISH.get(finish, finish)}
    if req.kind == "chat":
        out["message"] = {"role": "assistant", "content": text}
    else:
        out["text"] = text
    out["logprobs"] = None
    if req.return_token_ids and token_ids is not None:
        out["token_ids"] = list(token_ids)
    return out


def response(req: GenerationRequest, rid: str, created: int, choices: list, use: dict) -> dict:
    obj = "chat.completion" if req.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": choices, "usage": use}


def chunk(req: GenerationRequest, rid: str, created: int, index: int, text: str | None, finish: str | None = None,
          token_ids=None, role: bool = False) -> dict:
    """One server-sent event of a stream (``role=True``: the chat stream's opening chunk, as OpenAI sends)."""
    c = {"index": index, "finish_reason": FINISH.get(finish, finish), "logprobs": None}
    if req.kind == "chat":
        c["delta"] = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
    else:
        c["text"] = text or ""
    if req.return_token_ids and token_ids is not None:
        c["token_ids"] = list(token_ids)
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    out = {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [c]}
    if req.include_usage:  # OpenAI: with include_usage every chunk has "usage", null until the last one
        out["usage"] = None
    return out


def usage_chunk(req: GenerationRequest, rid: str, created: int, use: dict) -> dict:
    """The last chunk when ``stream_options.include_usage``: no choices, the request's usage."""
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [], "usage": use}
