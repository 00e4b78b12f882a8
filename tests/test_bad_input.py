"""Bad input gets a clear ValueError -- and requests already admitted finish exactly, with no leak."""
import pytest
import torch

from cbteach import Engine, Request, SamplingParams, static_batching
from conftest import EOS, VOCAB, drain, reference, tiny_model

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
    "tokenizer's input_ids": (lambda: Request(torch.tensor([[7, 8]]), 3),  # (said "token ids must be ints")
                              "the prompt is a batch of 1 prompt(s), shaped like a tokenizer's input_ids"),
    "nested list": (lambda: Request([[7, 8], [9]], 3), "a batch of 2 prompt(s)"),
    "set prompt": (lambda: Request({7, 8}, 3), "prompt must be a str or a list of token ids, not set"),
    "dict prompt": (lambda: Request({7: 8}, 3), "prompt must be a str or a list of token ids, not dict"),
    "stop id outside the vocabulary": (lambda: Request([7, 8], 3, sampling_params=SamplingParams(
        stop_token_ids=[VOCAB + 3])), f"stop token id {VOCAB + 3} is outside the vocabulary"),
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
    drain(eng)
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
    with pytest.raises(ValueError, match="did you mean 'scheduler_cls' for 'scheduler'") as err:
        Engine(model, max_batch_size=2, kv="paged", scheduler=object)
    import inspect

    from cbteach.core.config import BUILD_OPTIONS
    from cbteach.engine.engine_core import EngineCore
    own = [n for n, p in inspect.signature(EngineCore.__init__).parameters.items() if p.kind is p.KEYWORD_ONLY]
    assert set(BUILD_OPTIONS) <= set(own) and all(n in str(err.value) for n in set(own) - {"max_batch_size", "kv"})
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        Engine(tiny_model("llama"), max_batch_size=2, kv="paged", block_size=0)
    with pytest.raises(ValueError, match="token_budget"):
        Engine(model, max_batch_size=2, token_budget=0)


def test_preempting_to_admit_under_a_policy_that_never_lets_anyone_is_refused(model):
    """``preempt_to_admit=True`` with first come, first served was accepted and did nothing: no waiting request
    outranks a running one there."""
    from cbteach.engine.policies import FCFSQueue, PriorityQueue

    for policy in ("fcfs", FCFSQueue()):
        with pytest.raises(ValueError, match="preempt_to_admit=True does nothing under the policy 'fcfs'"):
            Engine(model, max_batch_size=2, kv="paged", preempt_to_admit=True, policy=policy)

    class Aging(FCFSQueue):  # a policy of one's own that says who may
        def may_preempt(self, waiting, running):
            return PriorityQueue.may_preempt(self, waiting, running)

    Engine(model, max_batch_size=2, kv="paged", preempt_to_admit=True, policy=Aging())


def test_options_that_would_be_silently_ignored_are_refused(model):
    """``serve --speculative ''`` started without speculation."""
    with pytest.raises(ValueError, match="speculative must be None"):
        Engine(model, max_batch_size=2, kv="paged", speculative="")


def test_a_block_larger_than_the_models_positions_is_refused():
    """``serve --block-size 100000`` on a 4,096-position model made a pool of 800,000 slots (2 GB) for nothing."""
    model = tiny_model("llama")  # 256 positions
    with pytest.raises(ValueError, match="block_size=257 is more than the model's 256 positions"):
        Engine(model, max_batch_size=2, kv="paged", block_size=257)
    Engine(model, max_batch_size=2, kv="paged", block_size=256)


def test_request_larger_than_the_pool_is_refused(model):
    eng = Engine(tiny_model("llama"), max_batch_size=2, kv="paged", block_size=4, num_blocks=3)
    with pytest.raises(ValueError, match="needs up to 4 KV blocks of 4 tokens but the pool has only 3"):
        eng.add_request(Request([7] * 10, 4))
    eng.add_request(Request([7] * 10, 3))  # 12 tokens, 11 stored: fits in 3 blocks
    drain(eng)


@pytest.mark.parametrize("options, why", [(dict(num_blocks=10**9), "num_blocks=1,000,000,000"),
                                          (dict(kv_memory_bytes=1e18), "kv_memory_bytes=1e[+]18"),
                                          (dict(num_blocks=10**9, tensor_parallel_size=2), "num_blocks="),
                                          (dict(max_batch_size=65536), "room for max_batch_size=65,536 sequences")])
def test_a_pool_larger_than_free_memory_is_refused_before_it_is_allocated(model, options, why):
    # (before: 10**9 blocks were allocated until the machine killed the process for memory)
    sized = model
    if "max_batch_size" in options:  # the default pool: room for every slot at the model's length, here 4,096
        sized = tiny_model("llama")
        sized.config.max_position_embeddings = 4096
    with pytest.raises(ValueError, match=rf"a KV pool of [\d,]+ blocks \(.*{why}.*\) needs [\d,.]+ GiB on cpu, which has "
                                         r".* free: give fewer blocks"):
        Engine(sized, kv="paged", **{"max_batch_size": 2, **options})
    got = Engine(model, max_batch_size=2, kv="paged", num_blocks=64).run([Request([7, 8, 9], 6)])
    assert got[0].output_ids == reference(model, [7, 8, 9], 6)


def test_the_pool_check_on_cuda_counts_the_allocators_unused_memory_and_a_ranks_share(monkeypatch):
    """(No GPU needed: torch's CUDA memory queries are stood in for.) Free = the driver's free memory plus what
    torch's allocator reserved and does not use; with tensor parallelism on GPUs each rank holds its share."""
    from cbteach.kv import memory

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100, 1000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 50)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 20)
    assert memory.free_memory("cuda") == 130
    memory.check_pool_fits(13, 10, "cuda")  # 130 bytes: fits
    memory.check_pool_fits(26, 10, "cuda", world_size=2)  # 260 bytes over two GPUs: 130 each
    with pytest.raises(ValueError, match="a KV pool of 14 blocks needs 0.0 GiB on cuda"):
        memory.check_pool_fits(14, 10, "cuda")


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

    from cbteach.core.modelinfo import eos_ids_for

    m = tiny_model("qwen2")
    assert eos_ids_for(m) == {EOS}
    # generate stops on the generation config's ids only: a tokenizer's other EOS is not added
    assert eos_ids_for(m, SimpleNamespace(eos_token_id=9)) == {EOS}
    m.generation_config.repetition_penalty = 1.05
    with pytest.warns(UserWarning, match="repetition_penalty"):
        Engine(m, max_batch_size=2)
    for name, value in (("num_beams", 2), ("exponential_decay_length_penalty", (2, 50.0))):
        m = tiny_model("qwen2")  # beam search, or an EOS pushed up with length: generate's answer changes
        setattr(m.generation_config, name, value)
        with pytest.warns(UserWarning, match=name):
            Engine(m, max_batch_size=2)


@pytest.mark.parametrize("kv", ["concat", "paged"])
@pytest.mark.parametrize("options, message", [
    (dict(block_size=0), "block_size must be an integer >= 1"),
    (dict(num_blocks=-5), "num_blocks"),
    (dict(kv_memory_bytes="x"), "kv_memory_bytes must be None or a finite number of bytes > 0"),
    (dict(kv_memory_bytes=float("inf")), "kv_memory_bytes must be None or a finite number"),
    (dict(kv_memory_bytes=0), "kv_memory_bytes must be None or a finite number"),
    (dict(num_blocks=4, kv_memory_bytes=4096), "give num_blocks or kv_memory_bytes, not both"),
    (dict(bucket_shapes="no"), "bucket_shapes must be None"),
    (dict(prefix_caching="no"), "prefix_caching must be True or False"),
    (dict(watermark=1), "watermark must be a fraction"),
    (dict(policy=[]), "policy must be one of"),
    (dict(policy={}), "policy must be one of"),
    (dict(num_speculative_tokens=0), "num_speculative_tokens must be an integer >= 1"),
    (dict(speculative="ngram", num_speculative_tokens=0), "num_speculative_tokens must be an integer >= 1"),
    (dict(speculative="bierce-draft"), r"got 'bierce-draft': for a draft model by name, the engine takes the model "
                                       r"itself, loaded \(speculative=cbteach.load_model\(name\)\[0\]\)"),
    (dict(num_speculative_tokens=5), r"num_speculative_tokens=5 sets how many tokens speculation guesses per step, "
                                     r"and speculative is None"),
    (dict(speculative=None, num_speculative_tokens=3), "give speculative='ngram' or a draft model, or leave"),
    (dict(keep_records="no"), "keep_records must be True"),
    (dict(keep_records=1), "keep_records must be True"),
])
def test_bad_engine_options_are_refused_whatever_the_cache(model, kv, options, message):
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match=message):
        Engine(model, max_batch_size=2, kv=kv, **options)
    assert model.config._attn_implementation == before


def test_not_a_model_or_not_a_list_of_requests(model):
    with pytest.raises(ValueError, match="model must be a transformers causal LM"):
        Engine(None, max_batch_size=2)
    with pytest.raises(ValueError, match="tokenizer must be None or a transformers tokenizer"):
        Engine(model, "gpt2", max_batch_size=2)  # a name is not a tokenizer
    eng = Engine(model, max_batch_size=2)
    with pytest.raises(ValueError, match=r"takes a list of Requests; for one request pass \[request\]"):
        eng.run(Request([7], 2))
    with pytest.raises(ValueError, match="takes a list of Requests, got NoneType"):
        eng.run(None)
    with pytest.raises(ValueError, match=r"got dict; for a dict of them pass list\(d.values\(\)\)"):
        eng.run({"a": Request([7], 2)})
    with pytest.raises(ValueError, match="expected a cbteach.Request, got tuple"):
        static_batching(model, None, [([7], 2)], 2)
    with pytest.raises(ValueError, match="takes a list of Requests"):
        static_batching(model, None, Request([7], 2), 2)
    assert not eng.has_unfinished()


@pytest.mark.parametrize("seed", [2**70, -2**64, 2.5])
def test_a_seed_torch_cannot_take_is_refused_before_anything_runs(model, seed):
    from cbteach.core.sampling import SamplingParams

    with pytest.raises(ValueError, match=r"seed must be None or an int in \[-2\*\*63, 2\*\*64\)"):
        SamplingParams(temperature=1.0, seed=seed)
    SamplingParams(temperature=1.0, seed=2**64 - 1)  # the largest torch.Generator takes
    SamplingParams(temperature=1.0, seed=-2**63)


def test_a_draft_model_must_share_the_vocabulary_and_may_be_shorter(model):
    from transformers import LlamaConfig, LlamaForCausalLM

    def draft(vocab, positions):
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=positions)
        return LlamaForCausalLM(cfg).eval()

    for vocab in (VOCAB - 1, VOCAB + 5):
        with pytest.raises(ValueError, match=f"the draft model has {vocab} token ids and the model {VOCAB}"):
            Engine(model, max_batch_size=2, kv="paged", speculative=draft(vocab, 256))
    # A draft with fewer positions than the request needs guesses less near its end, then not at all.
    eng = Engine(model, max_batch_size=2, kv="paged", speculative=draft(VOCAB, 20), num_speculative_tokens=3)
    r = Request([7] * 16, 12, ignore_eos=True)
    assert eng.run([r])[0].output_ids == reference(model, r.prompt, 12, eos_id=-1)
    assert 0 < eng.spec_stats["drafted"] < 3 * 11


def test_the_engines_leave_a_model_in_training_mode_as_they_found_it():
    gpt2 = tiny_model("gpt2")  # dropout 0.1: in training mode its outputs would be random
    reqs = [Request([7, 8, 9], 6), Request([10], 4)]
    want = [reference(gpt2, r.prompt, r.max_new_tokens) for r in reqs]
    gpt2.train()
    for kv in ("concat", "paged"):
        got = Engine(gpt2, max_batch_size=2, kv=kv).run([Request(r.prompt, r.max_new_tokens) for r in reqs])
        assert [c.output_ids for c in got] == want and gpt2.training
    got = static_batching(gpt2, None, [Request(r.prompt, r.max_new_tokens) for r in reqs], 2)
    assert [c.output_ids for c in got] == want and gpt2.training
    draft = tiny_model("gpt2", seed=1).train()
    eng = Engine(gpt2, max_batch_size=2, kv="paged", speculative=draft)
    assert [c.output_ids for c in eng.run([Request(r.prompt, r.max_new_tokens) for r in reqs])] == want
    assert gpt2.training and draft.training and all(m.training for m in gpt2.modules())


def test_a_generation_config_without_eos_stops_nothing_as_in_generate():
    from cbteach.core.modelinfo import eos_ids_for

    m = tiny_model("qwen2")
    m.generation_config.eos_token_id = None  # config.eos_token_id is still set: generate ignores it
    assert eos_ids_for(m) == frozenset()
    ids = torch.tensor([[7, 8, 9]])
    want = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=30)[0, 3:].tolist()
    assert Engine(m, max_batch_size=1).run([Request([7, 8, 9], 30)])[0].output_ids == want


def test_a_model_whose_weights_were_never_loaded_or_are_split_is_refused(model):
    """Weights on the 'meta' device (built under init_empty_weights) or on two devices: refused when the engine is
    built -- before, a meta model was taken and every run failed inside a step, holding a block."""
    meta = tiny_model("llama").to("meta")
    for kv in ("concat", "paged"):
        with pytest.raises(ValueError, match="'meta' device: they were never loaded"):
            Engine(meta, max_batch_size=2, kv=kv)
    split = tiny_model("llama")
    split.lm_head.to("meta")
    with pytest.raises(ValueError, match="'meta' device"):
        Engine(split, max_batch_size=2)


@pytest.mark.parametrize("tokenizer", ["gpt2", 5, object()])
def test_a_tokenizer_that_is_not_one_is_refused_when_the_engine_is_built(model, tokenizer):
    """A name where a tokenizer goes (``Engine(model, "gpt2")``) was taken, and the first finished request
    failed inside a step with an AttributeError, leaving its neighbours stuck."""
    with pytest.raises(ValueError, match="tokenizer must be None or a transformers tokenizer"):
        Engine(model, tokenizer, max_batch_size=2, kv="paged")


def test_a_tokenizer_that_gives_nested_ids_and_a_clock_that_is_not_one_are_refused(model):
    class Batched:  # called on one text, it answers as if given a batch
        def __call__(self, text):
            return {"input_ids": [[7, 8]]}

        def decode(self, ids, **kw):
            return " ".join(map(str, ids))

    eng = Engine(model, Batched(), max_batch_size=2, kv="paged")
    with pytest.raises(ValueError, match="not a flat list of token ids"):
        eng.add_request(Request("hello", 3))
    assert eng.run([Request([7, 8], 3)])[0].output_ids == reference(model, [7, 8], 3)
    for clock in (5, "wall", lambda: 0.0):  # (a clock has advance() too: the engine moves a simulated one)
        with pytest.raises(ValueError, match="clock must be None"):
            Engine(model, max_batch_size=2, clock=clock)


def test_a_batch_too_large_to_allocate_and_a_draft_never_loaded_are_refused(model):
    """max_batch_size=10**9 asked the worker for terabytes (a RuntimeError from torch); a draft model on the
    'meta' device was taken and failed the first step, holding blocks."""
    from cbteach.core.config import MAX_BATCH_SIZE

    for make in (lambda n: Engine(model, max_batch_size=n), lambda n: static_batching(model, None, [Request([7], 2)], n)):
        with pytest.raises(ValueError, match=f"at most {MAX_BATCH_SIZE:,}"):
            make(10**9)
    with pytest.raises(ValueError, match="the draft model's weights are on the 'meta' device"):
        Engine(model, max_batch_size=2, kv="paged", speculative=tiny_model("llama").to("meta"))


def test_static_batching_stops_on_stop_token_ids_as_the_engine_does(model):
    first = reference(model, [7, 8, 9], 1)[0]
    req = lambda: Request([7, 8, 9], 6, sampling_params=SamplingParams(stop_token_ids=[first]))  # noqa: E731
    got = static_batching(model, None, [req()], 2)[0]
    want = Engine(model, max_batch_size=2).run([req()])[0]
    assert (got.output_ids, got.finish_reason) == (want.output_ids, want.finish_reason) == ([first], "stop")


@pytest.mark.parametrize("given", [lambda ids: (t for t in ids), lambda ids: map(int, ids), lambda ids: iter(ids)])
def test_stop_token_ids_from_a_generator_or_an_iterator_stop_the_request(model, given):
    """A generator was used up by the check of its ids and kept as (): the request ran past its stop token."""
    first = reference(model, [7, 8, 9], 1)[0]
    params = SamplingParams(stop_token_ids=given([first]))
    assert params.stop_token_ids == (first,)
    got = Engine(model, max_batch_size=2).run([Request([7, 8, 9], 6, sampling_params=params)])[0]
    assert (got.output_ids, got.finish_reason) == ([first], "stop")
    with pytest.raises(ValueError, match="stop_token_ids must be a list of token ids"):
        SamplingParams(stop_token_ids={first: 1})


def test_a_tokenizer_that_cannot_decode_one_answer_fails_that_request_alone(bierce):
    """A sentencepiece tokenizer raises on an id past its vocabulary (a model may pad its own): the request
    whose answer will not decode ends with ``finish_reason="error"`` and its tokens; the others are exact."""
    model, tok = bierce
    bad = Engine(model, tok, max_batch_size=2, kv="paged").run([Request("Ink", 3)])[0].output_ids

    class Picky:  # the real tokenizer, but it cannot decode that one answer
        def __getattr__(self, name):
            return getattr(tok, name)

        def __call__(self, *args, **kwargs):
            return tok(*args, **kwargs)

        def decode(self, ids, **kwargs):
            if list(ids) == bad:
                raise IndexError("piece id is out of range")
            return tok.decode(ids, **kwargs)

    eng = Engine(model, Picky(), max_batch_size=2, kv="paged")
    a, b = eng.run([Request("Ink", 3), Request("The engine", 6)])
    assert (a.finish_reason, a.output_ids, a.text) == ("error", bad, None) and "IndexError" in a.error
    want = reference(model, b.prompt_ids, 6, eos_id=model.generation_config.eos_token_id)
    assert (b.output_ids, b.text) == (want, tok.decode(want, skip_special_tokens=True))
    assert eng.kv_usage()["num_used_blocks"] == 0
    a, b = static_batching(model, Picky(), [Request("Ink", 3), Request("The engine", 6)], 2)  # (and static batching)
    assert (a.finish_reason, a.output_ids, a.text) == ("error", bad, None) and "IndexError" in a.error
    assert (b.output_ids, b.text) == (want, tok.decode(want, skip_special_tokens=True))


@pytest.mark.parametrize("kv", ["concat", "paged"])
def test_a_tokenizer_that_cannot_decode_one_streamed_answer_ends_that_request_alone(bierce, kv):
    """The same in a stream: the request whose tokens will not decode gets a closing event with
    ``finish_reason="error"`` as soon as it happens, and gives its blocks back; the other streams on, exact."""
    model, tok = bierce
    a_ids, b_ids = tok("CYNIC, n.")["input_ids"], tok("EXECUTIVE, n.")["input_ids"]
    want_a = reference(model, a_ids, 12, eos_id=model.generation_config.eos_token_id)
    want_b = reference(model, b_ids, 12, eos_id=model.generation_config.eos_token_id)
    bad = next(t for t in want_b[1:] if t not in want_a)  # b says it after its first token, a never does

    class Picky:  # the real tokenizer, but it cannot decode that id (sentencepiece past its vocabulary)
        def __getattr__(self, name):
            return getattr(tok, name)

        def __call__(self, *args, **kwargs):
            return tok(*args, **kwargs)

        def decode(self, ids, **kwargs):
            if bad in list(ids):
                raise IndexError("piece id is out of range")
            return tok.decode(ids, **kwargs)

    eng = Engine(model, Picky(), max_batch_size=2, kv=kv)
    events = list(eng.stream([Request(a_ids, 12, request_id="a"), Request(b_ids, 12, request_id="b")]))
    mine = {rid: [e for e in events if e.request_id == rid] for rid in "ab"}
    assert [e.token_id for e in mine["a"]] == want_a and mine["a"][-1].finish_reason is not None
    assert "".join(e.text for e in mine["a"]) == tok.decode(want_a, skip_special_tokens=True)
    closing = mine["b"][-1]
    assert (closing.token_id, closing.finish_reason) == (None, "error")
    assert [e.finish_reason for e in mine["b"]].count("error") == 1 and all(e.finish_reason is None
                                                                             for e in mine["b"][:-1])
    assert [e.token_id for e in mine["b"][:-1]] == want_b[:want_b.index(bad)]  # up to the token that will not decode
    got = eng.completions["b"]
    assert got.finish_reason == "error" and "IndexError" in got.error and got.output_ids == want_b[:len(got.output_ids)]
    assert eng.completions["a"].output_ids == want_a and not eng.has_unfinished()
    if kv == "paged":
        assert eng.kv_usage()["num_used_blocks"] == 0


def test_an_arrival_a_clock_reading_away_is_refused_and_a_long_wait_is_said(model, monkeypatch):
    """``time.perf_counter()`` or ``time.monotonic()`` passed as an arrival_time would make the engine sleep
    for as long as the machine has been up: over a day away on the wall clock, it is refused with the reason."""
    import cbteach.engine.engine as engine_module

    eng = Engine(model, max_batch_size=2)
    for add in (lambda r: eng.run([Request([7], 2), r]), eng.add_request):
        with pytest.raises(ValueError, match=r"not a reading of time.perf_counter\(\) or time.monotonic\(\)"):
            add(Request([8], 2, arrival_time=2 * 86_400.0))
    assert not eng.has_unfinished() and not eng.sequences  # nothing was queued
    slept = []
    monkeypatch.setattr(engine_module.time, "sleep", slept.append)  # (no real wait: the clock is read, not slept)
    eng.add_request(Request([8], 2, arrival_time=eng.now() + 3_600.0))
    eng.step()
    with pytest.warns(UserWarning, match="idle until the next arrival_time, 3,600 s from now"):
        eng.wait_for_arrival()
    assert slept and 3_500 < slept[0] <= 3_600
    eng.close()


@pytest.mark.parametrize("base", ["llama", "gpt2"])
def test_a_base_model_without_a_language_model_head_is_refused(base):
    body = tiny_model(base).base_model  # LlamaModel, GPT2Model: hidden states, no logits
    with pytest.raises(ValueError, match="base model without a language-model head"):
        Engine(body, max_batch_size=2)


def test_odd_types_for_stop_ids_managers_callbacks_and_tokenizers_get_a_value_error(model):
    import numpy as np

    assert SamplingParams(stop_token_ids=torch.tensor([3, 4])).stop_token_ids == (3, 4)  # as prompts may be tensors
    assert SamplingParams(stop_token_ids=np.array([5])).stop_token_ids == (5,)
    with pytest.raises(ValueError, match="stop_token_ids must be a list of token ids"):
        SamplingParams(stop_token_ids=torch.tensor(3))
    with pytest.raises(ValueError, match=r"builds the class as object\(num_blocks, block_size\)"):
        Engine(model, max_batch_size=2, kv="paged", kv_manager=object)
    eng = Engine(model, max_batch_size=2, kv="paged")
    with pytest.raises(ValueError, match="on_release.. takes a function"):
        eng.on_release(5)

    class Odd:  # a tokenizer that gives a plain list, or raises
        eos_token_id = EOS

        def __call__(self, text, **kwargs):
            if text == "boom":
                raise RuntimeError("boom")
            return [7, 8]

        def decode(self, ids, **kwargs):
            return ""

    eng = Engine(model, Odd(), max_batch_size=2)
    for text in ("hi", "boom"):
        with pytest.raises(ValueError, match="the tokenizer could not encode the prompt"):
            eng.run([Request([7], 2), Request(text, 2)])
    assert not eng.sequences
