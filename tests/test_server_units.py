"""The API server's parts without a server: the incremental detokenizer, the prompt checks, the messages to and
from the engine cores, the output processor's bookkeeping, the coalesced stream writes, and the metrics."""
import asyncio
import random

import pytest

pytest.importorskip("msgspec", reason="the serve extra is not installed (pip install 'cbteach[serve]')")

from cbteach.serving import core_messages as msg  # noqa: E402
from cbteach.serving import openai_protocol as proto  # noqa: E402
from cbteach.serving.detokenizer import IncrementalDetokenizer  # noqa: E402
from cbteach.serving.output_processor import OutputProcessor, RequestState  # noqa: E402
from cbteach.serving.server_metrics import ServerMetrics, parse  # noqa: E402
from cbteach.serving.tokenization import PromptChecker  # noqa: E402


@pytest.fixture(scope="module")
def tok(bierce):
    return bierce[1]


@pytest.fixture(scope="module")
def spm_like():
    """A SentencePiece-style tokenizer (Metaspace "▁" spaces, byte fallback), trained here in a moment."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from cbteach.bierce.corpus import headword_prompts

    t = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    t.train_from_iterator([p + " to be or not, é ü ß — ok" for p in headword_prompts(200)] * 3,
                          trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "</s>", *bytes_]))
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="</s>", unk_token="<unk>")


def stream(tokenizer, ids, stop=(), seed=0):
    """Feed ``ids`` in random step sizes; the pieces sent and the detokenizer."""
    rng, d, pieces, i = random.Random(seed), IncrementalDetokenizer(tokenizer, stop), [], 0
    while i < len(ids) and not d.stopped:
        k = rng.choice([1, 1, 1, 2, 3])
        pieces.append(d.add(ids[i:i + k]))
        i += k
    pieces.append(d.finish())
    return pieces, d


@pytest.mark.parametrize("which", ["bierce", "spm_like"])
def test_incremental_text_adds_up_to_one_full_decode(request, which):
    tokenizer = request.getfixturevalue("tok" if which == "bierce" else which)
    rng = random.Random(1)
    for trial in range(150):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 120))]
        pieces, _ = stream(tokenizer, ids, seed=trial)
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True), (which, ids)


def test_a_text_answer_streams_its_characters_whole(spm_like):
    ids = spm_like("to be or not, é ü ß — ok")["input_ids"]
    pieces, _ = stream(spm_like, ids)
    assert "".join(pieces) == spm_like.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces)  # a character split over byte tokens waits for its last byte


def test_detokenizing_is_linear_not_quadratic(tok):
    rng = random.Random(2)
    ids = [rng.randrange(len(tok)) for _ in range(2000)]
    d = IncrementalDetokenizer(tok)
    for t in ids:
        d.add([t])
    assert d.num_decoded_tokens < 15 * len(ids)  # re-decoding every answer every step: 2,001,000


def test_stop_strings_cut_the_text_where_a_full_decode_would(tok):
    rng = random.Random(3)
    for trial in range(100):
        ids = [rng.randrange(len(tok)) for _ in range(60)]
        full = tok.decode(ids, skip_special_tokens=True)
        if len(full) < 12:
            continue
        at = rng.randrange(2, len(full) - 6)
        stop = full[at:at + rng.randint(1, 5)]
        pieces, d = stream(tok, ids, stop=(stop, "NEVER-THERE"), seed=trial)
        text = "".join(pieces)
        assert text == full[:full.index(stop)] and d.stopped
        assert all(stop not in "".join(pieces[:k + 1]) for k in range(len(pieces)))  # never sent, even in part
        assert d.num_decoded_tokens < 15 * len(ids)


class CountingTokenizer:
    def __init__(self, tok):
        self.tok, self.calls = tok, 0
        self.backend_tokenizer = getattr(tok, "backend_tokenizer", None)

    def __call__(self, text, **kw):
        self.calls += 1
        return self.tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_a_prompt_too_long_to_fit_is_refused_before_it_is_tokenized(tok):
    counting = CountingTokenizer(tok)
    checker = PromptChecker(counting, max_positions=4096, vocab_size=len(tok))
    try:
        with pytest.raises(proto.APIError) as err:
            asyncio.run(checker.to_ids("a" * 900_000, 4))
        assert err.value.status == 400 and err.value.code == "context_length_exceeded" and counting.calls == 0
        assert asyncio.run(checker.to_ids("CYNIC, n.", 4)) == tok("CYNIC, n.")["input_ids"] and counting.calls == 1
        long_but_possible = "q. " * 3000  # could fit by its length; it has 9,000 tokens
        assert len(long_but_possible) <= (4096 - 4) * checker.max_chars_per_token
        with pytest.raises(proto.APIError, match="9000 tokens"):
            asyncio.run(checker.to_ids(long_but_possible, 4))  # tokenized in the worker thread, then refused
        assert counting.calls == 2
        with pytest.raises(proto.APIError, match="vocabulary"):
            asyncio.run(checker.to_ids([1, len(tok)], 4))
    finally:
        checker.close()


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_an_integer_past_floats_range_is_a_400_naming_the_field(field):
    """JSON allows any integer; 10**400 overflows float() -- a 500 before."""
    with pytest.raises(proto.APIError) as err:
        proto.parse_completion({"prompt": "x", "max_tokens": 4, field: 10 ** 400}, proto.Limits("bierce", 100))
    assert err.value.status == 400 and err.value.param == field and "must be in" in str(err.value)


def test_a_null_field_is_the_same_as_a_missing_one():
    """``"max_tokens": null`` gets the server's default as a missing field does, never past the cap; ``n``,
    ``temperature`` and ``stop`` alike."""
    limits = proto.Limits(served_model="bierce", max_tokens_cap=8, default_max_tokens=6)
    missing = proto.parse_completion({"prompt": "x"}, limits)
    null = proto.parse_completion({"prompt": "x", "max_tokens": None, "n": None, "temperature": None, "stop": None},
                                  limits)
    assert missing == null and null.max_tokens == 6 and null.n == 1 and null.stop == ()
    with pytest.raises(proto.APIError, match="'max_tokens' is required"):
        proto.parse_completion({"prompt": "x", "max_tokens": None}, proto.Limits("bierce", max_tokens_cap=8))


def test_what_a_field_holds_is_checked_too_and_null_model_is_the_default():
    """Misspelt ``stream_options`` keys and answer-changing keys inside chat messages (``tool_calls`` on a user
    message) passed silently, where a misspelt top-level field is refused; keys left null, as a client sends a
    message back as it came, still pass. ``"model": null`` was refused where every other null is the default;
    too many prompts was blamed on ``n``."""
    limits = proto.Limits(served_model="bierce", max_tokens_cap=8, max_n=4)
    with pytest.raises(proto.APIError) as e:
        proto.parse_completion({"prompt": "x", "max_tokens": 2, "stream": True,
                                "stream_options": {"include_usgae": True}}, limits)
    assert (e.value.param, e.value.code) == ("stream_options", "unknown_parameter") and "include_usgae" in e.value.message
    assert "'include_usage' only" in e.value.message
    user = {"role": "user", "content": "hi"}
    for extra in ({"tool_calls": [{"id": "x"}]}, {"bogus": 1}):
        with pytest.raises(proto.APIError) as e:
            proto.parse_chat({"messages": [{**user, **extra}], "max_tokens": 2}, limits, None)
        assert e.value.param == "messages" and repr(next(iter(extra))) in e.value.message, e.value.message
    back = {"role": "assistant", "content": "yo", "tool_calls": None, "refusal": None, "function_call": None}
    assert proto.parse_chat({"messages": [user, back, user], "max_tokens": 2}, limits, None).max_tokens == 2
    assert proto.parse_completion({"prompt": "x", "max_tokens": 2, "model": None}, limits).model == "bierce"
    with pytest.raises(proto.APIError) as e:
        proto.parse_completion({"prompt": list("abcde"), "max_tokens": 2}, limits)
    assert e.value.param == "prompt"
    with pytest.raises(proto.APIError) as e:
        proto.parse_completion({"prompt": ["a", "b"], "max_tokens": 2, "n": 3}, limits)
    assert e.value.param == "n"


def test_messages_round_trip_compactly():
    out = msg.StepOutputs(core=1, step=7, t=0.5, outputs=[msg.SeqOutput(f"r{i}", [100 + i], i, "decode", 1)
                                                          for i in range(16)],
                          finished=[msg.Finished("r3", "error", "sampling failed")], accepted=["r20"])
    data = msg.encoder.encode(out)
    assert msg.output_decoder.decode(data) == out
    assert len(data) < 400  # array-like structs: no field names on the wire
    add = msg.AddRequest("r9", [1, 2, 3], 16, seed=4)
    assert msg.input_decoder.decode(msg.encoder.encode(add)) == add
    with pytest.raises(msgspec_errors()):
        msg.input_decoder.decode(msg.encoder.encode(out))  # an output is not an input


def msgspec_errors():
    import msgspec

    return msgspec.ValidationError


def state(rid, tok, queue, prompt=(1, 2, 3), max_tokens=10, stop=(), index=0):
    return RequestState(rid, list(prompt), max_tokens, IncrementalDetokenizer(tok, stop), queue, index)


def test_the_output_processor_keeps_each_cores_load_and_ends_requests_once(tok):
    async def go():
        q = asyncio.Queue()
        p = OutputProcessor(metrics=ServerMetrics("m", 2))
        p.load = [0, 0]
        aborted = []
        p.abort_in_core = lambda st: aborted.append(st.request_id)
        a, b = state("a", tok, q), state("b", tok, q, stop=(tok.decode([300]),), index=1)
        p.add(a, 0)
        p.add(b, 1)
        assert p.load == [13, 13]  # prompt + max_tokens each
        p.process(msg.StepOutputs(core=0, step=0, t=0, accepted=["a"], outputs=[msg.SeqOutput("a", [200])]))
        assert p.load == [9, 13]  # a's prompt is computed, one of its ten tokens made
        p.process(msg.StepOutputs(core=1, step=0, t=0, accepted=["b"], outputs=[msg.SeqOutput("b", [300])]))
        assert aborted == ["b"] and "b" not in p.states and p.load == [9, 0]  # its stop string: dropped in the core
        p.process(msg.StepOutputs(core=0, step=1, t=0, outputs=[msg.SeqOutput("a", [201])],
                                  finished=[msg.Finished("a", "length")]))
        p.process(msg.StepOutputs(core=0, step=2, t=0, finished=[msg.Finished("a", "length")]))  # (late: ignored)
        assert p.load == [0, 0] and not p.states
        events = [q.get_nowait() for _ in range(q.qsize())]
        finishes = [(i, e[1]) for i, e in events if e[0] == "finish"]
        assert sorted(finishes) == [(0, "length"), (1, "stop")]
        return parse(p.metrics.render())

    m = asyncio.run(go())
    assert m['cbteach:request_success_total{model_name="m",finished_reason="stop"}'] == 1
    assert m['cbteach:request_success_total{model_name="m",finished_reason="length"}'] == 1


def test_a_tokenizer_failing_on_one_requests_ids_ends_that_request_alone(tok):
    """A sentencepiece tokenizer raises on an id past its vocabulary (a model may pad its own): the request
    whose ids fail ends with an error, told to its core; the others, in the same message, go on."""

    class Picky:
        def __init__(self, inner, bad):
            self.inner, self.bad = inner, bad

        def decode(self, ids, **kw):
            if self.bad in ids:
                raise IndexError("piece id is out of range")
            return self.inner.decode(ids, **kw)

    async def go():
        q = asyncio.Queue()
        p = OutputProcessor(metrics=ServerMetrics("m", 1))
        p.load = [0]
        aborted = []
        p.abort_in_core = lambda st: aborted.append(st.request_id)
        picky = Picky(tok, bad=999)
        a = RequestState("a", [1, 2], 10, IncrementalDetokenizer(picky), q, 0)
        b = RequestState("b", [1, 2], 10, IncrementalDetokenizer(picky), q, 1)
        p.add(a, 0)
        p.add(b, 0)
        p.process(msg.StepOutputs(core=0, step=0, t=0, outputs=[msg.SeqOutput("a", [999]), msg.SeqOutput("b", [200])]))
        p.process(msg.StepOutputs(core=0, step=1, t=0, outputs=[msg.SeqOutput("b", [201])],
                                  finished=[msg.Finished("b", "length")]))
        return aborted, [q.get_nowait() for _ in range(q.qsize())], p

    aborted, events, p = asyncio.run(go())
    finishes = {i: e[1:] for i, e in events if e[0] == "finish"}
    assert aborted == ["a"] and not p.states
    assert finishes[0][0] == "error" and "IndexError" in finishes[0][2]
    assert finishes[1] == ("length", 2, None)
    assert "".join(e[1] for i, e in events if i == 1 and e[0] == "delta") == tok.decode([200, 201], skip_special_tokens=True)


def test_a_stream_that_fell_behind_writes_what_waits_in_one_send(tok):
    from cbteach.serving.server_app import Run

    class Client:
        def abort(self, st):
            st.done = True

    fe = type("FE", (), {"client": Client()})()
    req = proto.parse_completion({"prompt": "x", "max_tokens": 5, "stream": True}, proto.Limits("bierce", 100))

    async def go():
        run = Run(req, fe, created=0.0)
        run.states, run.finished, run.early = [state("r", tok, run.queue)], [None], []
        for word in ("a", "b", "c"):
            run.queue.put_nowait((0, ("delta", word, [1])))
        run.queue.put_nowait((0, ("finish", "length", 3, None)))
        return [part async for part in run.sse()]

    writes = asyncio.run(go())
    assert len(writes) == 2 and writes[0].count(b"data: ") == 4 and writes[1] == b"data: [DONE]\n\n"


def test_failures_are_not_counted_as_successes():
    m = ServerMetrics("m")
    st = type("S", (), {"created": 0.0, "prompt_ids": [1]})()
    for reason in ("eos", "length", "abort", "error", "dead"):
        m.finished(st, reason, 1.0)
    got = parse(m.render())
    assert got['cbteach:request_success_total{model_name="m",finished_reason="stop"}'] == 1
    assert got['cbteach:request_failure_total{model_name="m",reason="abort"}'] == 1
    assert got['cbteach:request_failure_total{model_name="m",reason="error"}'] == 2
    assert got['cbteach:e2e_request_latency_seconds_count{model_name="m"}'] == 2


@pytest.mark.parametrize("kv", ["paged", "concat", "paged, 2 ranks"])
def test_an_injected_fault_fails_that_request_alone(bierce, kv):
    """The fault injector the tests' servers use: paged, a real failure in the forward pass (the engine reruns the
    step one by one and ends only the marked request); concat -- and paged over two tensor-parallel ranks, whose
    model never runs in the core (it was ignored there) -- the request ended as such a failure would end it."""
    from cbteach import Engine, Request
    from cbteach.serving.faults import FaultInjector

    model, tok = bierce
    tp = kv == "paged, 2 ranks"
    kv = "paged" if tp else kv
    with Engine(model, tok, max_batch_size=4, kv=kv, keep_records=False, tensor_parallel_size=2 if tp else 1) as eng:
        faults = FaultInjector(eng)
        for rid, prompt in (("a", "CYNIC, n."), ("b", "BORE, n."), ("c", "ALONE, adj.")):
            eng.add_request(Request(prompt, 12, request_id=rid))
        faults.add("b", 3)
        ended = {}
        for _ in range(40):
            if not eng.has_unfinished():
                break
            record = eng.step()
            outputs = [msg.SeqOutput(s.request_id, list(s.new_token_ids)) for s in record.seqs]
            for f in faults.after_step(outputs, eng.abort):
                ended[f.request_id] = (f.finish_reason, f.error)
            for rid in record.finished:
                ended[rid] = (eng.sequences[rid].finish_reason, eng.sequences[rid].error)
        assert ended["b"][0] == "error" and "fault injected" in ended["b"][1]
        if kv == "paged" and not tp:
            assert len(eng.sequences["b"].output_ids) == 3  # it failed at its fourth token's forward pass
        for rid, prompt in (("a", "CYNIC, n."), ("c", "ALONE, adj.")):
            x = torch_ids(tok, prompt)
            want = model.generate(x, attention_mask=x.new_ones(x.shape), do_sample=False, max_new_tokens=12,
                                  pad_token_id=0)[0, x.shape[1]:].tolist()
            assert eng.sequences[rid].output_ids == want and ended[rid][0] in ("eos", "length")
        assert eng.kv_usage().get("num_used_blocks", 0) == 0


def torch_ids(tok, text):
    import torch

    return torch.tensor([tok(text)["input_ids"]])


def test_the_engine_core_sends_one_message_per_step_and_forgets_what_it_served(bierce):
    """The core's loop pieces in this process (inproc sockets): adds in, one StepOutputs per step out, an abort
    that frees at once, a refusal reported, and no finished request kept."""
    import zmq

    from cbteach import Engine
    from cbteach.serving.engine_core import CoreSpec, EngineCore

    model, tok = bierce
    ctx = zmq.Context()
    push_in, inbox, outbox, sink = (ctx.socket(k) for k in (zmq.PUSH, zmq.PULL, zmq.PUSH, zmq.PULL))
    push_in.bind("inproc://in"), inbox.connect("inproc://in"), outbox.bind("inproc://out"), sink.connect("inproc://out")
    try:
        with Engine(model, tok, max_batch_size=4, kv="paged", num_blocks=40, keep_records=False) as eng:
            core = EngineCore(CoreSpec(0, "", "", 0), eng, inbox, outbox)
            for rid, n in (("a", 5), ("b", 9), ("c", 30)):
                push_in.send(msg.encoder.encode(msg.AddRequest(rid, tok("CYNIC, n.")["input_ids"], n)))
            push_in.send(msg.encoder.encode(msg.AddRequest("huge", [1] * 700, 10)))  # 45 blocks: never fits
            messages, tokens = [], {}
            for _ in range(100):
                core._take_inputs()
                if not eng.has_unfinished():
                    break
                core._step()
                messages.append(msg.output_decoder.decode(sink.recv()))
                for o in messages[-1].outputs:
                    tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if len(tokens.get("b", [])) == 4:
                    push_in.send(msg.encoder.encode(msg.Abort(["c"])))
            assert [m.step for m in messages] == list(range(len(messages))) and core.stats.num_steps == len(messages)
            assert messages[0].accepted == ["a", "b", "c"] and messages[0].rejected[0][0] == "huge"
            assert (len(tokens["a"]), len(tokens["b"])) == (5, 9) and len(tokens["c"]) < 30
            assert {f.request_id for m in messages for f in m.finished} == {"a", "b"}  # c was aborted, not finished
            assert eng.sequences == {} and eng.completions == {}  # nothing kept
            assert eng.kv_usage()["num_used_blocks"] == 0
    finally:
        ctx.destroy(linger=0)


def test_metrics_are_prometheus_client_s_in_one_registry_an_operator_can_extend():
    from prometheus_client import Counter
    from prometheus_client.parser import text_string_to_metric_families

    m = ServerMetrics("m", 2)
    st = type("S", (), {"created": 0.0, "prompt_ids": [1, 2, 3], "first_token_at": None, "last_token_at": None})()
    m.accepted(st)
    m.tokens(st, 1, 0.02)
    m.finished(st, "length", 0.5)
    mine = Counter("my_own_events", "An operator's own metric.", registry=m.registry)
    mine.inc(3)
    families = {f.name: f for f in text_string_to_metric_families(m.render())}  # Prometheus' own parser reads it
    assert families["cbteach:time_to_first_token_seconds"].type == "histogram"
    assert families["cbteach:num_requests_running"].type == "gauge"
    assert families["cbteach:engine_core_steps"].type == "counter"
    got = parse(m.render())
    assert got["my_own_events_total"] == 3  # the operator's metric, scraped with the server's
    assert got['cbteach:prompt_tokens_total{model_name="m"}'] == 3
    assert got['cbteach:time_to_first_token_seconds_bucket{model_name="m",le="0.02"}'] == 1
    assert got['cbteach:time_to_first_token_seconds_bucket{model_name="m",le="0.01"}'] == 0
    assert got['cbteach:e2e_request_latency_seconds_count{model_name="m"}'] == 1
    assert got['cbteach:num_requests_running{model_name="m",engine="1"}'] == 0


def test_fields_that_change_nothing_are_taken_and_the_others_refused_as_unsupported():
    """``best_of: 1``, ``echo: false``, ``top_logprobs: 0`` ask for nothing this server lacks: taken. Answer-changing
    values are refused as *unsupported* (the field is known), a misspelt field as *unknown*."""
    limits = proto.Limits(served_model="bierce", max_tokens_cap=8)
    taken = {"best_of": 1, "echo": False, "top_logprobs": 0, "logprobs": None, "presence_penalty": 0.0, "top_k": -1,
             "logit_bias": {}, "user": "u", "store": False, "skip_special_tokens": True}
    assert proto.parse_completion({"prompt": "x", "max_tokens": 2, **taken}, limits).max_tokens == 2
    for field, value in [("best_of", 2), ("best_of", True), ("echo", True), ("top_logprobs", 2), ("logprobs", 0),
                         ("top_k", 50), ("min_tokens", 3), ("presence_penalty", 0.5)]:
        with pytest.raises(proto.APIError) as e:
            proto.parse_completion({"prompt": "x", "max_tokens": 2, field: value}, limits)
        assert (e.value.param, e.value.code) == (field, "unsupported_parameter"), (field, value, e.value.message)
    with pytest.raises(proto.APIError) as e:
        proto.parse_completion({"prompt": "x", "max_tokens": 2, "max_token": 2}, limits)
    assert (e.value.param, e.value.code) == ("max_token", "unknown_parameter")


@pytest.mark.parametrize("field, value", [("store", "yes"), ("metadata", [1]), ("metadata", {"k": 5}),
                                          ("service_tier", 3), ("parallel_tool_calls", 1), ("modalities", "text"),
                                          ("modalities", ["text", "audio"]), ("user", 5)])
def test_a_bookkeeping_field_of_the_wrong_type_is_named(field, value):
    """``store``, ``metadata``, ``service_tier``, ``parallel_tool_calls``, ``modalities`` change nothing here and were
    taken with any value: ``modalities: ["audio"]`` asked for an answer this server cannot give."""
    limits = proto.Limits(served_model="bierce", max_tokens_cap=8)
    with pytest.raises(proto.APIError) as e:
        proto.parse_chat({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, field: value}, limits, None)
    assert e.value.status == 400 and e.value.param == field and f"'{field}' must be" in e.value.message
    fine = {"store": True, "metadata": {"k": "v"}, "service_tier": "auto", "parallel_tool_calls": False,
            "modalities": ["text"], "user": "u"}
    assert proto.parse_completion({"prompt": "x", "max_tokens": 2, **fine}, limits).max_tokens == 2


@pytest.mark.parametrize("seed", range(6))
def test_a_step_of_several_tokens_ends_at_the_stop_string_as_single_tokens_do(tok, seed):
    """A speculative step brings several tokens; the answer's ids and its usage went past the token that completed
    a stop string (the text was cut): the same greedy request answered ``[221, 326, 298]``, 3 tokens, with
    speculation and ``[221, 326]``, 2, without. Whatever the steps' sizes, the events are the same."""
    g = random.Random(seed)
    ids = [g.randrange(200, 400) for _ in range(12)]
    stop = tok.decode(ids[g.randrange(3, 9)])[-1:] or "e"  # a character the answer reaches somewhere

    def events(sizes):
        async def go():
            q = asyncio.Queue()
            p = OutputProcessor()
            p.load, p.abort_in_core = [0], lambda st: None
            p.add(state("a", tok, q, max_tokens=len(ids), stop=(stop,)), 0)
            at = 0
            for n in sizes:
                if "a" not in p.states:
                    break
                p.process(msg.StepOutputs(core=0, step=at, t=0, outputs=[msg.SeqOutput("a", ids[at:at + n])]))
                at += n
            got = [q.get_nowait()[1] for _ in range(q.qsize())]
            text = "".join(e[1] for e in got if e[0] == "delta")
            return text, [t for e in got if e[0] == "delta" for t in e[2]], [e for e in got if e[0] == "finish"]
        return asyncio.run(go())

    one_a_step = events([1] * len(ids))
    sizes = []
    while sum(sizes) < len(ids):
        sizes.append(g.randint(1, 4))
    assert events(sizes) == one_a_step
    assert one_a_step[2] and one_a_step[2][0][1] == "stop" and one_a_step[2][0][2] == len(one_a_step[1])


def test_a_request_priority_reaches_the_engine_and_the_policy_reads_it():
    """``priority`` (vLLM's extension) was refused as an unknown field, so ``serve --policy priority`` ordered
    every request by arrival alone. It is read, and an engine core with the priority policy admits the urgent
    request first."""
    limits = proto.Limits("bierce", 100)
    assert proto.parse_completion({"prompt": "x", "max_tokens": 4}, limits).priority == 0
    assert proto.parse_completion({"prompt": "x", "max_tokens": 4, "priority": -3}, limits).priority == -3
    same = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 4, "max_tokens": 4}
    assert proto.parse_chat(same, limits, None).max_tokens == 4
    from cbteach import Engine
    from cbteach.serving.engine_core import CoreSpec, EngineCore
    from conftest import tiny_model

    eng = Engine(tiny_model("llama"), max_batch_size=1, policy="priority")
    core = EngineCore(CoreSpec(0, "", "", 0), eng, None, None)
    core._add(msg.AddRequest("late", [7, 8, 9], 2, priority=5))
    core._add(msg.AddRequest("urgent", [7, 8], 2, priority=-1))
    assert core.rejected == [] and eng.step().admitted == ["urgent"]
