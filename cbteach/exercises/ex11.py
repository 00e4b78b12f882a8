"""Notebook 11: read a streamed chat answer as a client must -- ``summarize_stream(events) -> (text,
num_tokens, finish_reason)``, compared with the same server's whole (not streamed) answers.
"""
from __future__ import annotations

import json
from typing import NamedTuple

from . import fail, is_int, is_stub, need_function, passed, raised, self_check


class Case(NamedTuple):
    prompt: str
    max_tokens: int
    stop: list | None  # stop strings


CASES = [Case(prompt="CYNIC, n.", max_tokens=12, stop=None), Case(prompt="CYNIC, n.", max_tokens=40, stop=["Government"]),
         Case(prompt="ALONE, adj.", max_tokens=150, stop=None)]
TIMEOUT_S = 60


def stream_events(base_url: str, prompt: str, max_tokens: int, stop=None, api_key: str | None = None,
                  stream: bool = True):
    """The JSON chunks of one streamed chat answer (``[DONE]`` left out), as a client receives them; with
    ``stream=False`` the same request answered whole: the response the stream must add up to."""
    import httpx

    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stop": stop,
            **({"stream": True, "stream_options": {"include_usage": True}} if stream else {})}
    args = dict(json=body, headers={"Authorization": f"Bearer {api_key}"} if api_key else {}, timeout=TIMEOUT_S)
    with httpx.stream("POST", base_url.rstrip("/") + "/v1/chat/completions", **args) as r:
        r.raise_for_status()
        if not stream:
            return json.loads(r.read())
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def several_tokens_a_chunk(events) -> list:
    """The same stream as a server sends it when some chunks carry several tokens (vLLM's speculative decoding
    does): every two consecutive chunks of content joined into one."""
    out, joined = [], False
    for e in json.loads(json.dumps(events)):
        choice = (e.get("choices") or [{}])[0]
        delta = choice.get("delta") or {}
        last = out[-1]["choices"][0] if out and out[-1].get("choices") else {}
        if (not joined and isinstance(delta.get("content"), str) and "role" not in delta and not choice.get(
                "finish_reason") and isinstance(last.get("delta", {}).get("content"), str)
                and "role" not in last["delta"] and not last.get("finish_reason")):
            last["delta"]["content"] += delta["content"]
            joined = True
            continue
        out.append(e)
        joined = False
    return out


def _hint(events, got, want) -> str:
    (text, n, reason), (w_text, w_n, w_reason) = got, want
    usage = next((e["usage"] for e in events if e.get("usage")), {})
    if n != w_n:
        if len(events) - 3 <= n <= len(events):
            return ("a chunk is not a token: the first chunk of a chat stream carries only the role, the closing one "
                    "only the finish_reason, and the last one only the usage -- and one chunk may carry several "
                    "tokens. Where does the stream say how many tokens the answer had?")
        if n == w_n + usage.get("prompt_tokens", 0):
            return "that counts the prompt's tokens too: the answer's are the completion's"
        content = sum(1 for e in events for c in e.get("choices") or [] if (c.get("delta") or {}).get("content"))
        if n == usage.get("prompt_tokens") and n not in (content, content + 1):  # (not chunks counted, by chance)
            return "that is the prompt's token count (prompt_tokens): the answer's is completion_tokens"
        return "count the answer's tokens from the usage the stream ends with (stream_options include_usage)"
    if reason != w_reason:
        return "the finish_reason is set in the last chunk that has a choice (the usage chunk after it has none)"
    if text == w_text.strip() != w_text:
        return "the text was stripped: the answer's own spaces and newlines at its ends are part of it"
    return "join the delta's content of every chunk, in order; a chunk without content (the closing one) adds nothing"


def _raised_hint(err: Exception) -> str | None:
    """The stream's shape a reading that raised ``err`` missed (None: not one the check knows)."""
    said = str(err)
    if isinstance(err, TypeError) and "expected str instance, NoneType found" in said:
        return "a chunk's delta can be without content (the closing chunk's is {}): such a chunk adds no text"
    if isinstance(err, TypeError) and "NoneType" in said:
        return "every chunk has a usage key, null (None) in all but the last: look for the one whose usage is not None"
    if isinstance(err, IndexError):
        return "the stream's last chunk carries the usage and no choice (its choices list is empty)"
    if isinstance(err, KeyError) and err.args[:1] == ("content",):
        return "a chunk's delta can be without content (the closing chunk's is {}): such a chunk adds no text"
    return None


@self_check
def check_stream_summary(summarize_stream, base_url: str, api_key: str | None = None) -> bool:
    """Compare ``summarize_stream`` on real streams with the server's whole answers."""
    need_function(summarize_stream, "summarize_stream")
    for k, (prompt, max_tokens, stop) in enumerate(CASES):
        events = stream_events(base_url, prompt, max_tokens, stop, api_key)
        whole = stream_events(base_url, prompt, max_tokens, stop, api_key, stream=False)
        choice = whole["choices"][0]
        want = (choice["message"]["content"], whole["usage"]["completion_tokens"], choice["finish_reason"])
        where = f"the answer to {prompt!r} (max_tokens={max_tokens}{', stop=' + repr(stop) if stop else ''})"
        sent = [(events, where)] + ([(several_tokens_a_chunk(events), where + ", sent with several tokens in some "
                                      "chunks, as speculative decoding sends them")] if k == len(CASES) - 1 else [])
        for stream, said in sent:
            try:
                got = summarize_stream(json.loads(json.dumps(stream)))  # a copy: the learner may consume it
            except (TypeError, IndexError, KeyError) as err:
                hint = _raised_hint(err)
                if hint is None:
                    raise
                return fail(f"summarize_stream stopped with {raised(err)} -- {hint}")
            if got is None and is_stub(summarize_stream):
                return fail("not done yet: summarize_stream is still the stub -- write it in the cell above")
            if not isinstance(got, (tuple, list)) or len(got) != 3:  # (a list of the three is as good)
                return fail(f"return a tuple (text, num_tokens, finish_reason); got {type(got).__name__} {got!r:.60}")
            if not isinstance(got[0], str) or not is_int(got[1]):
                return fail("text should be a str and num_tokens an int")
            if tuple(got) != want:
                return fail(f"on {said}: {_hint(stream, got, want)}")
    return passed(f"all {len(CASES) + 1} streams read right: text, tokens and finish reason match the whole answers")
