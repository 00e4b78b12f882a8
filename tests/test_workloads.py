"""Benchmark workloads: deterministic for a seed, and shaped as cbteach/serving/workloads.py documents."""
import math

import numpy as np
import pytest

from cbteach.serving import workloads as wl
from cbteach.bierce.corpus import headword_prompts


@pytest.fixture(scope="module")
def tok(bierce):
    return bierce[1]


def test_headwords_are_the_tokenized_headword_prompts(tok):
    w = wl.headwords(tok, 5, max_new_tokens=40)
    assert len(w) == 5 and w.name == "headwords" and not w.ignore_eos and w.arrival_times is None
    assert [list(p) for p in w.prompts] == [tok(p)["input_ids"] for p in headword_prompts(5)]
    reqs = w.requests()
    assert [r.request_id for r in reqs] == ["r0", "r1", "r2", "r3", "r4"]
    assert all(r.max_new_tokens == 40 and r.arrival_time is None and not r.ignore_eos for r in reqs)
    again = w()  # fresh objects, the same content
    assert again[0] is not reqs[0] and [(r.prompt, r.max_new_tokens) for r in again] == \
        [(r.prompt, r.max_new_tokens) for r in reqs]
    assert w.output_lengths is None  # EOS decides


def test_exponential_lengths_are_clipped_draws():
    draws = np.random.default_rng(7).exponential(20.0, 50)
    got = wl.exponential_lengths(50, 20.0, 30, seed=7)
    assert got == [min(30, max(1, math.ceil(x))) for x in draws]
    assert wl.exponential_lengths(50, 20.0, 30, seed=7) == got  # seeded
    assert wl.exponential_lengths(50, 20.0, 30, seed=8) != got


def test_length_variance_same_prompts_growing_variance(tok):
    sweep = wl.length_variance_sweep(tok, 40, caps=(2, 8, 32, 128), mean=24.0, prompt_len=12, seed=3)
    assert [w.params["cap"] for w in sweep] == [2, 8, 32, 128]
    for w in sweep:
        assert w.ignore_eos and len(w) == 40 and w.prompt_lengths == [12] * 40
        assert w.prompts == sweep[0].prompts  # the same prompts at every cap
        assert all(1 <= n <= w.params["cap"] for n in w.max_new_tokens)
        assert w.output_lengths == list(w.max_new_tokens)
    # a cap far below the mean: (almost) every request has the same length
    assert np.mean(np.array(sweep[0].max_new_tokens) == 2) > 0.9
    stds = [np.std(w.max_new_tokens) for w in sweep]
    assert all(a < b for a, b in zip(stds, stds[1:]))  # the variance grows with the cap
    for small, big in zip(sweep, sweep[1:]):  # the same draws: raising the cap only lets long ones grow
        assert all(a == min(b, small.params["cap"]) for a, b in zip(small.max_new_tokens, big.max_new_tokens))
    again = wl.length_variance(tok, 40, 32, mean=24.0, prompt_len=12, seed=3)
    assert again == sweep[2]
    assert wl.length_variance(tok, 40, 32, mean=24.0, prompt_len=12, seed=4).prompts != again.prompts


def test_prompts_are_windows_of_the_corpus(tok):
    stream = wl.corpus_ids(tok)
    w = wl.length_variance(tok, 6, 8, prompt_len=10)
    text = " ".join(map(str, stream))
    for p in w.prompts:
        assert " ".join(map(str, p)) in text


def test_poisson_arrivals(tok):
    base = wl.headwords(tok, 8)
    w = wl.with_poisson_arrivals(base, rate=4.0, seed=1)
    t = w.arrival_times
    assert len(t) == 8 and t[0] == 0.0 and list(t) == sorted(t)
    assert w.prompts == base.prompts and w.params["rate"] == 4.0
    assert wl.with_poisson_arrivals(base, rate=4.0, seed=1) == w
    sweep = wl.poisson_sweep(base, (1.0, 2.0, 8.0), seed=1)
    for s in sweep:  # the same gaps, scaled by 1 / rate
        assert np.allclose(np.array(s.arrival_times) * s.params["rate"], sweep[0].arrival_times)
    assert [r.arrival_time for r in w.requests()] == list(t)
    assert wl.with_poisson_arrivals(base, math.inf).arrival_times is None
    with pytest.raises(ValueError, match="rate"):
        wl.with_poisson_arrivals(base, 0)
    # exponential gaps of mean 1 / rate (a long seeded draw, so the check is deterministic)
    gaps = wl.poisson_gaps(4000, seed=0)[1:]
    assert gaps and abs(np.mean(gaps) - 1.0) < 0.05 and abs(np.std(gaps) - 1.0) < 0.1


def test_chat_mix_is_long_tailed_with_sharegpt_proportions(tok):
    w = wl.chat(tok, 32, seed=5)
    assert w == wl.chat(tok, 32, seed=5) and w.ignore_eos
    assert all(4 <= n <= 128 for n in w.prompt_lengths) and all(1 <= n <= 192 for n in w.max_new_tokens)
    rng = np.random.default_rng(0)
    outs = wl.lognormal_lengths(20000, 40.0, 1.0, 1, 10**6, rng)
    assert abs(np.mean(outs) / 40.0 - 1) < 0.05  # the documented mean, before clipping
    assert np.mean(outs) > 1.4 * np.median(outs)  # long tail: the mean sits well above the median
    # outputs about twice as long as prompts, as in ShareGPT (338 / 161 tokens)
    big = wl.chat(tok, 400, seed=0, max_prompt=4000, max_output=4000)
    ratio = np.mean(big.max_new_tokens) / np.mean(big.prompt_lengths)
    assert 1.5 < ratio < 3.0


def test_summary_head_and_build(tok):
    w = wl.build("poisson", tok, 6, max_new_tokens=20, rate=10.0)
    s = w.summary()
    assert s["num_requests"] == 6 and s["prompt_len"]["min"] <= s["prompt_len"]["max"]
    assert s["max_new_tokens"]["max"] == 20 and s["arrivals"]["rate"] == 10.0
    assert len(w.head(2)) == 2 and len(w.head(2).arrival_times) == 2
    for name in wl.WORKLOADS:
        assert len(wl.build(name, tok, 3)) == 3
    with pytest.raises(ValueError, match="unknown workload"):
        wl.build("sharegpt", tok, 3)
    with pytest.raises(ValueError):
        wl.headwords(tok, 0)


@pytest.mark.parametrize("make, message", [
    (lambda tok: wl.build("headwords", tok, 2, max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (lambda tok: wl.build("poisson", tok, 2, max_new_tokens=-3), "max_new_tokens must be an integer >= 1"),
    (lambda tok: wl.build("poisson", tok, 2, rate="x"), "rate must be > 0"),
    (lambda tok: wl.length_variance(tok, n=2.0), "number of requests must be an integer"),
    (lambda tok: wl.length_variance(tok, 2, mean=-1), "mean must be a finite number > 0"),
    (lambda tok: wl.length_variance(tok, 2, seed=-1), "seed must be an integer >= 0"),
    (lambda tok: wl.chat(tok, 2, scale=0), "scale must be a finite number > 0"),
    (lambda tok: wl.chat(tok, 2, max_prompt=2), "max_prompt must be an integer >= 4"),
    (lambda tok: wl.chat(tok, 2, max_output=0), "max_output must be an integer >= 1"),
    (lambda tok: wl.headwords(tok, 3).head(-1), "number of requests must be an integer >= 1"),
])
def test_bad_workload_parameters_are_refused(tok, make, message):
    with pytest.raises(ValueError, match=message):
        make(tok)


def test_compare_refuses_a_repeat_below_one_and_reads_an_engine_string(tok):
    from cbteach.bench import compare
    from conftest import tiny_model

    w = wl.headwords(tok, 2, max_new_tokens=3)
    with pytest.raises(ValueError, match="repeat must be an integer >= 1"):
        compare(tiny_model("llama"), None, w, 2, engines=["static"], repeat=0)
    with pytest.raises(ValueError, match=r"unknown engine\(s\) \['nope'\]"):
        compare(tiny_model("llama"), None, w, 2, engines="static,nope")
