"""Bad input gets a clear ValueError -- and requests already admitted finish exactly, with no leak."""
import pytest

from cbteach import Engine, Request, static_batching
from conftest import EOS, VOCAB, reference, tiny_model

MAXPOS = 256

BAD = {
    "empty prompt": (lambda: Request([], 4), "empty"),
    "empty text prompt": (lambda: Request("", 4), "text prompt needs a tokenizer"),
    "too long": (lambda: Request([7] * 200, MAXPOS - 199), "exceeds the model's 256 positions"),
    "zero new tokens": (lambda: Request([7, 8], 0), "max_new_tokens must be an integer >= 1"),
    "negative new tokens": (lambda: Request([7, 8], -3), "max_new_tokens must be an integer >= 1"),
    "float new tokens": (lambda: Request([7, 8], 2.5), "max_new_tokens must be an integer >= 1"),
    "id too large": (lambda: Request([7, VOCAB], 3), f"outside the vocabulary; ids must be in [0, {VOCAB})"),
    "negative id": (lambda: Request([-1, 7], 3), "outside the vocabulary"),
    "not ids": (lambda: Request([7, "x"], 3), "must be ints"),
}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.mark.parametrize("kv", ["concat", "paged"])
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_request_is_refused_mid_run_without_harm(model, kv, case):
    make, message = BAD[case]
    good = [Request([7, 8, 9], 12), Request([10, 11], 20), Request([12], 9)]
    eng = Engine(model, max_batch_size=2, kv=kv, block_size=4)
    for r in good:
        eng.add_request(r)
    eng.step()
    eng.step()
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        eng.add_request(make())
    while eng.has_unfinished():
        eng.step()
    for r in good:
        assert eng.completions[r.request_id].output_ids == reference(model, r.prompt, r.max_new_tokens)
    if kv == "paged":
        usage = eng.kv_usage()
        assert usage["num_free_blocks"] == usage["num_blocks"]
        assert all(c == 0 for c in eng.kv.manager.allocator.ref_counts)


def test_exact_position_limit_is_allowed(model):
    r = Request([7] * 250, MAXPOS - 250)
    out = Engine(model, max_batch_size=1).run([r])
    assert out[0].output_ids == reference(model, r.prompt, r.max_new_tokens)


def test_duplicate_request_id(model):
    eng = Engine(model, max_batch_size=2)
    eng.add_request(Request([7], 3, request_id="x"))
    with pytest.raises(ValueError, match="duplicate request_id 'x'"):
        eng.add_request(Request([8], 3, request_id="x"))
    with pytest.raises(ValueError, match="duplicate"):
        Engine(model, max_batch_size=2).run([Request([7], 3, request_id=1), Request([8], 3, request_id=1)])
    with pytest.raises(ValueError, match="duplicate"):
        static_batching(model, None, [Request([7], 3, request_id=1), Request([8], 3, request_id=1)], 2)
    eng.run([])  # the first request still finishes
    assert eng.completions["x"].output_ids == reference(model, [7], 3)


def test_run_with_one_bad_request_changes_nothing(model):
    eng = Engine(model, max_batch_size=2)
    good = Request([7, 8], 5)
    with pytest.raises(ValueError, match="empty"):
        eng.run([good, Request([], 5)])
    assert not eng.has_unfinished()
    # the good request's id was not consumed: it can be run now
    assert eng.run([good])[0].output_ids == reference(model, [7, 8], 5)


@pytest.mark.parametrize("size", [0, -1, 1.5, None, True])
def test_max_batch_size_must_be_positive_int(model, size):
    with pytest.raises(ValueError, match="max_batch_size must be an integer >= 1"):
        Engine(model, max_batch_size=size)


@pytest.mark.parametrize("size", [0, -2])
def test_static_batch_size_must_be_positive(model, size):
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        static_batching(model, None, [Request([7], 2)], size)


def test_static_rejects_bad_request(model):
    with pytest.raises(ValueError, match="max_new_tokens"):
        static_batching(model, None, [Request([7], 2), Request([8], 0)], 2)


def test_unknown_options(model):
    with pytest.raises(ValueError, match="kv must be one of"):
        Engine(model, max_batch_size=2, kv="ring")
    with pytest.raises(ValueError, match="unknown engine option"):
        Engine(model, max_batch_size=2, speculate=True)
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        Engine(tiny_model("llama"), max_batch_size=2, kv="paged", block_size=0)
    with pytest.raises(ValueError, match="token_budget"):
        Engine(model, max_batch_size=2, token_budget=0)


def test_request_larger_than_the_pool_is_refused(model):
    eng = Engine(tiny_model("llama"), max_batch_size=2, kv="paged", block_size=4, num_blocks=3)
    with pytest.raises(ValueError, match="needs up to 4 KV blocks of 4 tokens but the pool has only 3"):
        eng.add_request(Request([7] * 10, 4))
    eng.add_request(Request([7] * 10, 3))  # 12 tokens, 11 stored: fits in 3 blocks
    while eng.has_unfinished():
        eng.step()


def test_sliding_window_models_are_refused():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=8,
                      max_window_layers=0)
    with pytest.raises(ValueError, match="sliding-window"):
        Engine(Qwen2ForCausalLM(cfg), max_batch_size=2)


def test_tensor_and_numpy_inputs_are_accepted(model):
    import numpy as np
    import torch

    reqs = [Request(torch.tensor([7, 8, 9]), np.int64(6)), Request(np.array([10, 11]), 4), Request((12,), 3)]
    got = Engine(model, max_batch_size=2).run(reqs)
    assert [c.output_ids for c in got] == [reference(model, [7, 8, 9], 6), reference(model, [10, 11], 4),
                                           reference(model, [12], 3)]
    assert all(type(t) is int for c in got for t in c.prompt_ids)


@pytest.mark.parametrize("arrival", [float("nan"), float("inf"), -1.0, "soon", True])
def test_bad_arrival_time(model, arrival):
    eng = Engine(model, max_batch_size=2)
    with pytest.raises(ValueError, match="arrival_time must be None .now. or a finite number of seconds >= 0"):
        eng.run([Request([7], 2), Request([8], 2, arrival_time=arrival)])
    assert not eng.has_unfinished() and not eng.sequences  # nothing was queued


def test_unhashable_id_bytes_prompt_and_bool_budget(model):
    eng = Engine(model, max_batch_size=2)
    with pytest.raises(ValueError, match="request_id must be hashable"):
        eng.add_request(Request([7], 2, request_id=["a"]))
    with pytest.raises(ValueError, match="not bytes"):
        eng.add_request(Request(b"\x07\x08", 2))
    with pytest.raises(ValueError, match="token_budget"):
        Engine(model, max_batch_size=2, token_budget=True)


def test_failed_paged_engine_leaves_the_model_alone():
    m = tiny_model("llama", attn="eager")
    with pytest.raises(ValueError, match="num_blocks must be an integer >= 1"):
        Engine(m, max_batch_size=2, kv="paged", num_blocks=0)
    with pytest.raises(ValueError, match="max_batch_size must be an integer >= 1"):
        Engine(m, max_batch_size=0, kv="paged")
    assert m.config._attn_implementation == "eager"


def test_static_finished_rows_stay_inside_the_position_table():
    gpt2 = tiny_model("gpt2")  # n_positions = 256, learned position embeddings
    reqs = [Request([7] * 255, 1), Request([8], 3)]
    got = static_batching(gpt2, None, reqs, 2)
    assert [c.output_ids for c in got] == [reference(gpt2, r.prompt, r.max_new_tokens) for r in reqs]


def test_eos_ids_union_and_ignored_generation_settings():
    from types import SimpleNamespace

    from cbteach.modelinfo import eos_ids_for

    m = tiny_model("qwen2")
    assert eos_ids_for(m) == {EOS}
    # generate stops on the generation config's ids only: a tokenizer's other EOS is not added
    assert eos_ids_for(m, SimpleNamespace(eos_token_id=9)) == {EOS}
    m.generation_config.repetition_penalty = 1.05
    with pytest.warns(UserWarning, match="repetition_penalty"):
        Engine(m, max_batch_size=2)
