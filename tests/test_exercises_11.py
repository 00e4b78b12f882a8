"""Notebook 11's check: the right reading of a stream passes; each typical mistake fails with a hint."""
import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'cbteach[serve]')")
pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install 'cbteach[serve]')")

from cbteach.exercises.ex11 import check_stream_summary  # noqa: E402


@pytest.fixture(scope="module")
def url():
    from cbteach.serving.server import ServerThread

    with ServerThread(["--port", "0"]) as s:
        yield s.url


def right(events):
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    reason = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]][-1]
    return text, events[-1]["usage"]["completion_tokens"], reason


def counts_chunks(events):
    return right(events)[0], len(events), right(events)[2]


def counts_content_chunks_and_the_prompt(events):
    return right(events)[0], events[-1]["usage"]["total_tokens"], right(events)[2]


def reason_from_last_event(events):
    return right(events)[0], right(events)[1], events[-1]["choices"][0]["finish_reason"]  # the usage chunk: no choice


def reason_from_first_event(events):
    return right(events)[0], right(events)[1], events[0]["choices"][0]["finish_reason"]


def joins_none(events):
    return "".join(c["delta"].get("content") for e in events for c in e["choices"]), *right(events)[1:]


def skips_first_token(events):
    return "".join(c["delta"].get("content") or "" for e in events[2:] for c in e["choices"]), *right(events)[1:]


def content_chunks_plus_the_stop(events):
    """One token per chunk with text, plus one for the EOS (or stop) that ends it: right while no stop string cuts
    the answer (the check's stop case never stopped once, and this passed)."""
    n = sum(1 for e in events for c in e["choices"] if c["delta"].get("content"))
    return right(events)[0], n + (right(events)[2] == "stop"), right(events)[2]


def counts_chunks_less_three(events):
    """Chunks less the role, closing and usage chunks: right while every chunk carries one token."""
    return right(events)[0], len(events) - 3, right(events)[2]


def indexes_content(events):
    return "".join(c["delta"]["content"] for e in events for c in e["choices"]), *right(events)[1:]


def prompt_tokens(events):
    return right(events)[0], events[-1]["usage"]["prompt_tokens"], right(events)[2]


def stripped(events):
    return right(events)[0].strip(), *right(events)[1:]


def usage_of_the_first_chunk(events):
    """The first chunk with a usage key: every chunk has one, null until the last."""
    return right(events)[0], next(e["usage"] for e in events if "usage" in e)["completion_tokens"], right(events)[2]


def test_several_tokens_a_chunk_keeps_the_text_and_the_usage():
    from cbteach.exercises.ex11 import several_tokens_a_chunk

    events = [{"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}], "usage": None}]
    events += [{"choices": [{"delta": {"content": w}, "finish_reason": None}], "usage": None} for w in "abcde"]
    events += [{"choices": [{"delta": {}, "finish_reason": "length"}], "usage": None},
               {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}}]
    joined = several_tokens_a_chunk(events)
    assert right(joined) == right(events) == ("abcde", 5, "length") and len(joined) == len(events) - 2


def test_the_stop_case_stops_on_its_stop_string(url):
    from cbteach.exercises.ex11 import CASES, stream_events

    for prompt, max_tokens, stop in [c for c in CASES if c.stop]:
        whole = stream_events(url, prompt, max_tokens, stop, stream=False)
        assert whole["choices"][0]["finish_reason"] == "stop", (prompt, stop, whole)


def test_right_answer_passes(url, capsys):
    assert check_stream_summary(right, url) is True
    assert "✓" in capsys.readouterr().out
    assert check_stream_summary(lambda events: list(right(events)), url) is True  # the three as a list: as good


@pytest.mark.parametrize("wrong, hint", [(counts_chunks, "a chunk is not a token"),
                                         (counts_content_chunks_and_the_prompt, "prompt"),
                                         (reason_from_last_event, "stopped with IndexError"),
                                         (reason_from_last_event, "last chunk carries the usage and no choice"),
                                         (reason_from_first_event, "finish_reason is set in the last chunk"),
                                         (joins_none, "stopped with TypeError: sequence item"),
                                         (joins_none, "the closing chunk's is {}): such a chunk adds no text"),
                                         (indexes_content, "stopped with KeyError: 'content'"),
                                         (indexes_content, "the closing chunk's is {}): such a chunk adds no text"),
                                         (skips_first_token, "join the delta's content"),
                                         (content_chunks_plus_the_stop, "count the answer's tokens from the usage"),
                                         (counts_chunks_less_three, "one chunk may carry several tokens"),
                                         (prompt_tokens, "the answer's is completion_tokens"),
                                         (stripped, "the text was stripped"),
                                         (usage_of_the_first_chunk, "null (None) in all but the last")])
def test_typical_mistakes_fail_with_a_hint(url, capsys, wrong, hint):
    assert check_stream_summary(wrong, url) is False
    out = capsys.readouterr().out
    assert "✗" in out and hint in out, out


def test_stub_and_non_functions_fail_without_a_traceback(url, capsys):
    def stub(events):
        ...

    assert check_stream_summary(stub, url) is False
    assert "not done yet" in capsys.readouterr().out  # (it read as a wrong answer: "got NoneType None")
    assert check_stream_summary(right(  # a value instead of the function
        [{"choices": [{"delta": {"content": "x"}, "finish_reason": "stop"}]}, {"choices": [], "usage": {
            "completion_tokens": 1}}]), url) is False
    assert check_stream_summary(right, "http://127.0.0.1:9") is False  # no server there: a hint, not a traceback
    assert capsys.readouterr().out.count("✗") == 2
