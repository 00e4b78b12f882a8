"""Metric definitions (vLLM's benchmark conventions), checked on hand-made completions."""
import pytest

from cbteach.serving.metrics import request_metrics, summarize
from cbteach.core.request import Completion


def comp(rid, arrival, times, reason="length"):
    return Completion(request_id=rid, prompt_ids=[1], output_ids=list(range(len(times))), finish_reason=reason,
                      arrival_time=arrival, first_token_time=times[0] if times else None, token_times=list(times),
                      finish_time=times[-1] if times else None)


def test_one_request():
    m = request_metrics(comp("a", 1.0, [1.5, 1.7, 2.0, 2.1]))
    assert m.ttft == pytest.approx(0.5)
    assert m.e2e == pytest.approx(1.1)
    assert m.tpot == pytest.approx((1.1 - 0.5) / 3)
    assert m.itls == pytest.approx([0.2, 0.3, 0.1])
    assert request_metrics(comp("b", 0.0, [0.25])).tpot is None


def test_summary_percentiles_throughput_and_goodput():
    cs = [comp("a", 0.0, [0.1, 0.2, 0.3]), comp("b", 0.0, [0.5, 0.6]), comp("c", 1.0, [1.2, 1.4, 2.0]),
          comp("d", 0.5, [], reason="aborted")]
    s = summarize(cs, ttft_target=0.25, tpot_target=0.2)
    assert s["num_requests"] == 4 and s["num_completed"] == 3
    assert s["duration"] == pytest.approx(2.0)  # first arrival 0.0 -> last finish 2.0
    assert s["output_tokens"] == 8 and s["tokens_per_s"] == pytest.approx(4.0)
    assert s["requests_per_s"] == pytest.approx(1.5)
    assert s["ttft_p50"] == pytest.approx(0.2) and s["ttft_mean"] == pytest.approx((0.1 + 0.5 + 0.2) / 3)
    assert s["itl_p50"] == pytest.approx(0.1)  # gaps 0.1, 0.1, 0.1, 0.2, 0.6 pooled
    assert s["e2e_p99"] == pytest.approx(1.0, abs=0.01)
    # a: ttft 0.1, tpot 0.1 (good); b: ttft 0.5 (too slow); c: ttft 0.2, tpot 0.5 (too slow)
    assert s["num_good"] == 1 and s["goodput"] == pytest.approx(0.5)


def test_no_token_is_refused_clearly():
    with pytest.raises(ValueError, match="produced no token"):
        request_metrics(comp("x", 0.0, []))


def test_metrics_from_a_real_run():
    from cbteach import Engine, Request
    from conftest import tiny_model

    eng = Engine(tiny_model("gpt2"), max_batch_size=2)
    got = eng.run([Request([7, 8], 5), Request([9], 3, arrival_time=0.01)])
    s = summarize(got)
    assert s["num_completed"] == 2 and s["output_tokens"] == sum(len(c.output_ids) for c in got)
    assert all(request_metrics(c).ttft >= 0 for c in got)


def test_summarize_takes_the_engines_dict_and_refuses_what_it_cannot_use():
    cs = [comp("a", 0.0, [0.1, 0.2, 0.3]), comp("b", 0.0, [0.5, 0.6])]
    assert summarize({c.request_id: c for c in cs}) == summarize(cs)
    with pytest.raises(ValueError, match="takes completions"):
        summarize(["a", "b"])
    for bad in (dict(duration=-1.0), dict(ttft_target=0), dict(tpot_target="fast")):
        with pytest.raises(ValueError, match="must be None or a number of seconds > 0"):
            summarize(cs, **bad)
