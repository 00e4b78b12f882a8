"""Speculative decoding inside the batch: greedy output is exactly the non-speculative output."""
import math
import random

import pytest

from cbteach import Engine, Request
from cbteach.engine.speculative import NgramProposer, accept
from conftest import VOCAB, reference, tiny_model

MODEL = tiny_model("llama")


def test_accept_keeps_agreeing_guesses_and_the_models_own_token():
    assert accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + a bonus token
    assert accept([5, 9, 7], [5, 6, 7, 8]) == [5, 6]  # first mismatch: the model's token instead
    assert accept([9], [5, 6]) == [5]
    assert accept([], [4]) == [4]


def test_accepted_guesses_are_counted_when_a_stop_cuts_the_step_short():
    from cbteach.engine.speculative import num_accepted

    guesses = [5, 6, 7]  # three guesses after the last known token
    assert num_accepted([5, 6, 7, 9], guesses) == 3  # all three kept + the model's own token
    assert num_accepted([5, 6], guesses) == 2  # the second guess (6) was EOS: the step stops there, both kept
    assert num_accepted([5, 8], guesses) == 1  # the second guess rejected, the model's 8 instead
    assert num_accepted([9], guesses) == 0  # the first guess rejected


def test_ngram_proposer_looks_up_the_latest_earlier_occurrence():
    p = NgramProposer(3)
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]
    assert p.propose([1, 2, 3], 2) == []
    assert p.propose([4, 5, 4], 3) == [5, 4]  # the 1-gram [4] was followed by 5, 4


def repetitive_requests(seed=0, n=6):
    g = random.Random(seed)
    reqs = []
    for i in range(n):
        motif = [g.randrange(6, VOCAB) for _ in range(g.randint(2, 5))]
        reqs.append(Request(motif * g.randint(2, 4) + [g.randrange(6, VOCAB)], g.randint(5, 30), request_id=i))
    return reqs


@pytest.mark.parametrize("kv", ["concat", "paged"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_speculation_is_exact(kv, k):
    reqs = repetitive_requests()
    eng = Engine(MODEL, max_batch_size=3, kv=kv, block_size=4, speculative="ngram", num_speculative_tokens=k)
    got = eng.run(reqs)
    assert [c.output_ids for c in got] == [reference(MODEL, r.prompt, r.max_new_tokens) for r in reqs]
    assert eng.spec_stats["drafted"] > 0
    assert 0 <= eng.spec_stats["accepted"] <= eng.spec_stats["drafted"]
    verify = [s for r in eng.records for s in r.seqs if s.num_draft_tokens]
    assert all(s.kind == "decode" and len(s.new_token_ids) <= s.num_draft_tokens + 1 for s in verify)
    if kv == "paged":
        assert eng.kv_usage()["num_free_blocks"] == eng.kv.num_blocks


def test_speculation_with_budget_small_pool_and_preemption_stays_exact():
    for seed in range(6):
        reqs = repetitive_requests(seed, n=5)
        bs = 2
        need = max(math.ceil((len(r.prompt) + r.max_new_tokens - 1) / bs) for r in reqs)
        eng = Engine(MODEL, max_batch_size=4, kv="paged", block_size=bs, num_blocks=need + 3, token_budget=7,
                     speculative="ngram", num_speculative_tokens=4, preemption=["recompute", "swap"][seed % 2])
        got = eng.run(reqs)
        assert [c.output_ids for c in got] == [reference(MODEL, r.prompt, r.max_new_tokens) for r in reqs]
        assert max(r.num_tokens for r in eng.records) <= 7
        assert eng.kv_usage()["num_free_blocks"] == eng.kv.num_blocks


def test_draft_model_speculation_is_exact_and_the_same_model_accepts_everything():
    reqs = repetitive_requests(3, n=4)
    eng = Engine(MODEL, max_batch_size=2, kv="paged", speculative=MODEL, num_speculative_tokens=3)
    got = eng.run(reqs)
    assert [c.output_ids for c in got] == [reference(MODEL, r.prompt, r.max_new_tokens) for r in reqs]
    # the target as its own draft: every guess is right (up to EOS, which generate stops at)
    assert eng.spec_stats["accepted"] >= 0.9 * eng.spec_stats["drafted"]


def test_streamed_speculative_tokens_are_each_an_event():
    reqs = repetitive_requests(1, n=3)
    eng = Engine(MODEL, max_batch_size=3, kv="paged", speculative="ngram", num_speculative_tokens=4)
    tokens = {}
    for ev in eng.stream(reqs):
        tokens.setdefault(ev.request_id, []).append(ev.token_id)
    assert [tokens[r.request_id] for r in reqs] == [reference(MODEL, r.prompt, r.max_new_tokens) for r in reqs]


def test_bad_speculative_options_are_refused():
    with pytest.raises(ValueError, match="speculative must be None, 'ngram' or a draft model"):
        Engine(MODEL, max_batch_size=1, speculative="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        Engine(MODEL, max_batch_size=1, speculative="ngram", num_speculative_tokens=0)


def test_bierce_draft_model_is_embedded_and_its_guesses_verify_exactly(bierce):
    from cbteach import load_model
    from cbteach.bierce.corpus import headword_prompts

    model, tok = bierce
    draft, draft_tok = load_model("bierce-draft", device="cpu")
    assert draft_tok.get_vocab() == tok.get_vocab()  # a draft must speak the target's token ids
    assert draft.config.vocab_size == model.config.vocab_size
    assert sum(p.numel() for p in draft.parameters()) < sum(p.numel() for p in model.parameters()) / 3
    reqs = lambda: [Request(p, 30) for p in headword_prompts(6)]  # noqa: E731
    plain = Engine(model, tok, max_batch_size=6, kv="paged").run(reqs())
    spec = Engine(model, tok, max_batch_size=6, kv="paged", speculative=draft, num_speculative_tokens=3)
    assert [c.output_ids for c in spec.run(reqs())] == [c.output_ids for c in plain]
    s = spec.spec_stats
    assert s["drafted"] > 0 and 0 < s["accepted"] < s["drafted"]
