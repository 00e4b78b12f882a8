"""Async scheduling (vLLM V1's ``async_scheduling``): step N+1 planned while step N's forward runs.

The tokens must be the synchronous engine's -- greedy ones equal per-prompt ``generate``, seeded ones
the same request run alone -- under chunked prefill, preemption, prefix caching and parallel
sampling, with no block leaked; the records must show the overlap; what async cannot run is refused.
"""
from __future__ import annotations

import random

import pytest

from cbteach import Engine, Request, SamplingParams
from conftest import ARCHS, VOCAB, reference, tiny_model


def workload(seed: int, n: int = 8) -> list[Request]:
    g = random.Random(seed)
    return [Request([g.randrange(6, VOCAB) for _ in range(g.randint(1, 30))], g.randint(1, 16), request_id=i,
                    ignore_eos=g.random() < 0.3) for i in range(n)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("options", [dict(), dict(token_budget=7), dict(num_blocks=12, block_size=4),
                                     dict(prefix_caching=True, block_size=4)])
def test_async_tokens_equal_generate(arch, options):
    model = tiny_model(arch)
    reqs = workload(ARCHS.index(arch) * 7 + 3)  # (a seed that is the same in every process)
    eng = Engine(model, max_batch_size=4, kv="paged", async_scheduling=True, **options)
    got = eng.run(reqs)
    assert [c.output_ids for c in got] == [reference(model, r.prompt, r.max_new_tokens) if not r.ignore_eos
                                           else reference(model, r.prompt, r.max_new_tokens, eos_id=-1)
                                           for r in reqs]
    usage = eng.kv_usage()
    assert usage["num_used_blocks"] == 0 and not eng.has_unfinished()


@pytest.mark.parametrize("mode", ["fanout", "fork"])
def test_async_seeded_samples_equal_the_synchronous_engines(mode):
    model = tiny_model("llama")
    reqs = [Request([7, 8, 9, 10, 11], 10, request_id="a", ignore_eos=True,
                    sampling_params=SamplingParams(temperature=1.0, seed=3, n=3)),
            Request([20, 21], 9, request_id="b", ignore_eos=True, sampling_params=SamplingParams(temperature=0.8, seed=1))]
    opts = dict(max_batch_size=4, kv="paged", block_size=4, num_blocks=14, parallel_sampling=mode)
    sync = Engine(model, **opts).run(reqs)
    fast = Engine(model, async_scheduling=True, **opts).run(reqs)
    assert [s.output_ids for s in fast[0].samples] == [s.output_ids for s in sync[0].samples]
    assert fast[1].output_ids == sync[1].output_ids


def test_the_records_show_planning_overlapping_the_forward():
    model = tiny_model("gpt2")
    eng = Engine(model, max_batch_size=4, kv="paged", async_scheduling=True)
    eng.run(workload(1, 6))
    steps = [r for r in eng.records if "forward" in r.timings and "schedule" in r.timings]
    overlapped = sum(1 for a, b in zip(steps, steps[1:]) if b.timings["schedule"][0] < a.timings["forward"][1])
    assert overlapped >= len(steps) // 2  # step N+1 was planned before step N's forward ended


def test_a_step_with_a_stop_in_flight_drops_the_next_steps_work():
    """A request that stops at EOS in step N may already be planned into N+1: its N+1 output is dropped."""
    model = tiny_model("llama")
    g = random.Random(0)
    for _ in range(200):  # a prompt that stops by itself early
        p = [g.randrange(6, VOCAB) for _ in range(4)]
        out = reference(model, p, 12)
        if len(out) < 12:
            break
    eng = Engine(model, max_batch_size=2, kv="paged", async_scheduling=True)
    got = eng.run([Request(p, 12), Request([30, 31], 12, ignore_eos=True)])
    assert got[0].output_ids == out and got[0].finish_reason == "eos"
    assert got[1].output_ids == reference(model, [30, 31], 12, eos_id=-1)


def test_abort_and_close_during_async_steps():
    model = tiny_model("qwen2")
    eng = Engine(model, max_batch_size=3, kv="paged", async_scheduling=True)
    eng.add_request(Request([7, 8, 9], 20, request_id="x", ignore_eos=True))
    eng.add_request(Request([10, 11], 6, request_id="y"))
    eng.step()
    eng.step()
    assert eng.abort("x").finish_reason == "aborted"
    eng.run([])
    assert eng.completions["y"].output_ids == reference(model, [10, 11], 6)
    eng.add_request(Request([12], 30, request_id="z", ignore_eos=True))
    eng.step()
    eng.close()
    assert eng.completions["z"].finish_reason == "aborted"


@pytest.mark.parametrize("options,message", [
    (dict(kv="concat"), "needs kv='paged'"),
    (dict(kv="paged", speculative="ngram"), "speculative"),
    (dict(kv="paged", preemption="swap"), "swap is V0's"),
    (dict(kv="paged", async_scheduling="yes"), "async_scheduling must be True or False"),
])
def test_what_async_cannot_run_is_refused(options, message):
    opts = {"async_scheduling": True, **options}
    with pytest.raises(ValueError, match=message):
        Engine(tiny_model("gpt2"), max_batch_size=2, **opts)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("step_at_once", [False, True])
def test_an_id_reused_after_release_gets_generates_tokens(async_scheduling, step_at_once):
    """A request that stops on a stop token has its next decode in flight (async). Released and added
    again under the same id, the new request must get ``generate``'s tokens -- not the old one's wasted
    token -- and the engine must go on (vLLM fixed the same race in its PR 27987)."""
    model = tiny_model("llama")
    p, q = [7, 8, 9, 10], [40, 41, 42]
    stop = reference(model, p, 12, eos_id=-1)[2]
    eng = Engine(model, max_batch_size=3, kv="paged", async_scheduling=async_scheduling)
    eng.add_request(Request(p, 12, request_id="A", ignore_eos=True,
                            sampling_params=SamplingParams(stop_token_ids=[stop])))
    eng.add_request(Request([30, 31], 12, request_id="B", ignore_eos=True))
    for _ in range(20):
        if "A" in eng.completions:
            break
        eng.step()
    assert eng.completions["A"].finish_reason == "stop"
    eng.release("A")
    eng.add_request(Request(q, 6, request_id="A", ignore_eos=True))
    if step_at_once:
        eng.step()
    eng.run([])
    assert eng.completions["A"].output_ids == reference(model, q, 6, eos_id=-1)
    assert eng.completions["B"].output_ids == reference(model, [30, 31], 12, eos_id=-1)
    assert eng.kv_usage()["num_used_blocks"] == 0


def test_async_steps_go_through_the_executor():
    """Every async step reaches the worker as ``executor.execute_model(plan, non_block=True)`` (vLLM V1's
    seam); nothing drives the model runner around it."""
    model = tiny_model("gpt2")
    eng = Engine(model, max_batch_size=4, kv="paged", async_scheduling=True)
    calls = []
    send = eng.executor.execute_model
    eng.executor.execute_model = lambda plan, non_block=False: (calls.append(non_block), send(plan, non_block))[1]
    reqs = workload(5, 5)
    got = eng.run(reqs)
    assert calls and all(calls) and len(calls) >= eng.num_steps
    assert [c.output_ids for c in got] == [reference(model, r.prompt, r.max_new_tokens) if not r.ignore_eos
                                           else reference(model, r.prompt, r.max_new_tokens, eos_id=-1) for r in reqs]
    with pytest.raises(ValueError, match="built for non_block=True"):
        send(eng.scheduler.schedule(eng.now()))  # a synchronous call on an async executor is refused


def test_step_n_plus_1_is_handed_over_before_step_n_is_waited_on():
    """V1's order at the engine core: the executor gets plan N+1 before N's output comes back, and what
    it returns with N+1's launch is N's output (the requests plan N scheduled, in the worker's order)."""
    model = tiny_model("llama")
    eng = Engine(model, max_batch_size=3, kv="paged", block_size=4, async_scheduling=True)
    sent, got = [], []
    send = eng.executor.execute_model

    def watched(plan, non_block=False):
        out = send(plan, non_block)
        sent.append(set(plan.num_scheduled_tokens))
        got.append(None if out is None else set(out.req_ids))
        return out

    eng.executor.execute_model = watched
    reqs = workload(7, 5)
    eng.run(reqs)
    assert got[0] is None  # the first launch has no step before it
    launched = [s for s in sent if s]
    answered = [g for g in got if g is not None]
    assert answered and answered == launched[:len(answered)]  # each answer is the step launched just before


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_worker_prepares_step_n_plus_1_while_step_n_is_in_flight(arch):
    """V1's order in the worker: plan N+1 changes the batch and N+1's inputs are read from it before the
    worker waits for N (cbteach.worker.async_runner) -- every step but the first is prepared with the step
    before it still in flight -- and the tokens are still generate's."""
    model = tiny_model(arch)
    eng = Engine(model, max_batch_size=3, kv="paged", block_size=4, async_scheduling=True)
    pipeline = eng.executor.pipeline
    prepare, in_flight = pipeline.runner.prepare_inputs, []

    def watched(msg):
        in_flight.append(pipeline.flight is not None)  # N not waited on yet
        return prepare(msg)

    pipeline.runner.prepare_inputs = watched
    reqs = workload(7, 5)
    got = eng.run(reqs)
    assert len(in_flight) > 5 and not in_flight[0] and all(in_flight[1:]), in_flight
    assert [c.output_ids for c in got] == [reference(model, r.prompt, r.max_new_tokens) if not r.ignore_eos
                                           else reference(model, r.prompt, r.max_new_tokens, eos_id=-1) for r in reqs]


def test_step_n_plus_1_is_queued_on_the_device_before_step_n_is_waited_on():
    """As a GPU runs what is queued on its stream: the worker hands N+1 to its device thread before it
    asks for N's result, so N+1 starts once N has sampled, without waiting for this thread
    (cbteach.worker.async_runner). Every result is asked for after the next step was queued, but the last."""
    model = tiny_model("llama")
    eng = Engine(model, max_batch_size=3, kv="paged", block_size=4, async_scheduling=True)
    device, order = eng.executor.pipeline.device, []
    submit = device.submit

    class Watched:
        def __init__(self, future, n):
            self.future, self.n = future, n

        def result(self):
            order.append(("result", self.n))
            return self.future.result()

    def watched(fn, *args):
        n = sum(1 for e, _ in order if e == "queued")
        order.append(("queued", n))
        return Watched(submit(fn, *args), n)

    device.submit = watched
    reqs = workload(7, 5)
    got = eng.run(reqs)
    asked = [n for e, n in order if e == "result"]
    assert len(asked) > 5 and asked == sorted(asked)
    for n in asked[:-1]:  # the last is drained, with nothing behind it
        assert order.index(("queued", n + 1)) < order.index(("result", n)), order
    assert [c.output_ids for c in got] == [reference(model, r.prompt, r.max_new_tokens) if not r.ignore_eos
                                           else reference(model, r.prompt, r.max_new_tokens, eos_id=-1) for r in reqs]


BAD = 95  # the model raises on any step that feeds this token


@pytest.mark.parametrize("how", ["raises", "nan"])
@pytest.mark.parametrize("seed", range(12))
def test_async_with_requests_the_model_fails_on_stays_exact_for_the_others(seed, how):
    """Randomised: prompts that share prefixes, some holding a token the model raises on (or gives NaN
    for), under chunked prefill, tight pools and prefix caching. Async scheduling prepares step N+1 before
    it learns that N failed: the worker runs N again a request at a time from their own states and
    prepares N+1 again.
    Every request the model does not fail on gets generate's tokens, the failed ones end with an error,
    and no block is left in use."""
    g = random.Random(seed)
    arch = ARCHS[seed % len(ARCHS)]
    model = tiny_model(arch)
    prefix = [g.randrange(6, VOCAB) for _ in range(g.randint(0, 9))]
    reqs = []
    for i in range(g.randint(3, 7)):
        prompt = (prefix if g.random() < 0.6 else []) + [g.randrange(6, VOCAB) for _ in range(g.randint(1, 10))]
        if g.random() < 0.35:
            prompt.insert(g.randrange(len(prompt) + 1), BAD)
        reqs.append(Request(prompt, g.randint(1, 10), request_id=i, ignore_eos=True))
    bs = g.choice([2, 4])
    need = max(-(-(len(r.prompt) + r.max_new_tokens) // bs) for r in reqs)
    opts = dict(max_batch_size=g.randint(2, 4), block_size=bs, num_blocks=need + g.randint(1, 3 * need),
                prefix_caching=g.random() < 0.7, token_budget=g.choice([None, g.randint(4, 12)]))
    eng = Engine(model, kv="paged", async_scheduling=True, **opts)
    handle = (model.register_forward_pre_hook(_refuse_bad, with_kwargs=True) if how == "raises"
              else model.get_input_embeddings().register_forward_hook(_nan_for_bad))
    try:
        got = eng.run(reqs)
    finally:
        handle.remove()
    for r, c in zip(reqs, got):
        want = reference(model, r.prompt, r.max_new_tokens, eos_id=-1) if BAD not in r.prompt else None
        if want is not None and BAD in want[:-1]:
            continue  # the model's own output feeds the token it refuses: that request fails too, rightly
        if want is None:
            assert c.finish_reason == "error", f"seed {seed}: {opts}, request {r.request_id}"
        else:
            assert c.error is None and c.output_ids == want, f"seed {seed}: {opts}, request {r.request_id}"
    assert eng.kv_usage()["num_used_blocks"] == 0 and not eng.has_unfinished()


def _refuse_bad(module, args, kwargs):
    if bool((kwargs["input_ids"] == BAD).any()):
        raise RuntimeError(f"the model refuses token {BAD}")


def _nan_for_bad(module, args, output):
    output[args[0] == BAD] = float("nan")
    return output


@pytest.mark.parametrize("arch", ARCHS)
def test_async_neighbour_reading_a_nan_requests_prefix_in_the_same_step_stays_exact(arch):
    """The model gives NaN for a token of one prompt (its embedding output is NaN). A neighbour admitted in
    the same step on that request's prefix -- a prefix-cache hit on blocks the failing request fills in
    that step -- reads NaN K/V: its logits are not finite too. The synchronous engine runs it again alone;
    under async scheduling the step behind must not read its token first. Only the request with the
    token fails; the neighbour (greedy, and a seeded one) gets the tokens it gets on its own."""
    model = tiny_model(arch)
    head = list(range(10, 22))
    good = Request(head + [7, 8], 6, request_id="good", ignore_eos=True)
    seeded = Request(head + [9], 6, request_id="seeded", ignore_eos=True,
                     sampling_params=SamplingParams(temperature=1.0, seed=3))
    bad = Request(head + [BAD, 5, 6], 3, request_id="bad")
    alone = Engine(model, max_batch_size=4, kv="paged", block_size=4).run([seeded])[0].output_ids
    handle = model.get_input_embeddings().register_forward_hook(_nan_for_bad)
    try:
        eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, prefix_caching=True,
                     async_scheduling=True)
        got = {c.request_id: c for c in eng.run([bad, good, seeded])}
        again = eng.run([Request(good.prompt, 6, ignore_eos=True)])[0]
    finally:
        handle.remove()
    assert eng.records[0].seqs[1].num_computed_tokens == len(head)  # (the case: a hit on blocks filled that step)
    assert got["bad"].finish_reason == "error" and "not finite" in got["bad"].error
    want = reference(model, good.prompt, 6, eos_id=-1)
    assert got["good"].error is None and got["good"].output_ids == want
    assert got["seeded"].error is None and got["seeded"].output_ids == alone
    assert again.output_ids == want  # the blocks the failed request left are not read as a cached prefix
    assert eng.kv_usage()["num_used_blocks"] == 0 and not eng.has_unfinished()


class _StubRunner:
    """A model runner without a model, for the async runner's own order: every step has two rows that
    sample; a step named in ``nan_steps`` samples a non-finite logit for its second row. It counts how often
    each step's forward pass runs."""

    def __init__(self, nan_steps):
        import numpy as np
        import torch

        self.device, self.nan_steps, self.forwards = torch.device("cpu"), set(nan_steps), {}
        self.input_batch = type("Batch", (), {"num_tokens": np.full(2, 100)})()

    def changes_pool_first(self, msg):
        return False

    def update_states(self, msg):
        pass

    def prepare_inputs(self, msg):
        import types

        import numpy as np
        import torch
        return types.SimpleNamespace(msg=msg, rows=[0, 1], req_ids=["a", "b"], starts=[0, 0], counts=[1, 1],
                                     samples=[True, True], input_ids=np.zeros(2, dtype=np.int64),
                                     meta=types.SimpleNamespace(input_ids=torch.zeros(1, 2, dtype=torch.long)))

    def prepare_again(self, msg, first):
        return self.prepare_inputs(msg)

    def forward(self, step):
        self.forwards[step.msg.name] = self.forwards.get(step.msg.name, 0) + 1

    def sample(self, step):
        import torch

        from cbteach.worker.model_runner import DeviceSample
        top = [0.0, float("nan") if step.msg.name in self.nan_steps else 0.0]
        step.sampled = DeviceSample(tokens=torch.tensor([1, 2]), top=torch.tensor(top))

    def finish(self, step):
        from cbteach.core.scheduler_output import RunnerOutput
        return RunnerOutput(sampled=[[1], [2]], req_ids=list(step.req_ids))

    def close(self):
        pass


def test_a_step_is_held_by_its_own_non_finite_logits_not_by_the_step_queued_behind_it():
    """Step 2's row has a non-finite logit; step 1 has none. While the caller waits for step 1, the device
    thread may get as far as step 2's sampling and mark the runner held (the subclass plays it getting that
    far before the caller looks: it sets the flag as soon as step 2 starts). Step 1 must still finish as a
    step that holds nothing: read as held, it was finished as if recovered, and step 2 was prepared again
    and run a second time (a seeded sample drew twice: wrong tokens, now and then, under load)."""
    import types

    from cbteach.worker.async_runner import AsyncModelRunner

    class Ahead(AsyncModelRunner):
        def feed(self, step, pending):
            super().feed(step, pending)
            if step.msg.name == "2":
                self.held = True  # (what step 2's sampling sets, moments later)

    stub = _StubRunner(nan_steps={"2"})
    runner = Ahead(stub)
    try:
        for name in ("1", "2"):
            runner.execute_model(types.SimpleNamespace(name=name, total_num_scheduled_tokens=2))
        runner.drain()
    finally:
        runner.close()
    assert stub.forwards == {"1": 1, "2": 1}
