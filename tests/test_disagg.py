"""Disaggregated prefill and decode (simulated): exact outputs, counted handovers, simulated time."""
import math
import random

import pytest

from cbteach import Engine, Request, SamplingParams
from cbteach.serving.disagg import DisaggregatedServer, VirtualClock
from cbteach.serving.metrics import summarize
from conftest import EOS, VOCAB, reference, tiny_model

MODEL = tiny_model("llama")


def workload(seed=0, n=8):
    g = random.Random(seed)
    return [Request([g.randrange(6, VOCAB) for _ in range(g.randint(1, 40))], g.randint(1, 20), request_id=i,
                    arrival_time=round(i * 0.002, 4)) for i in range(n)]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_outputs_are_exact_and_handovers_counted(block_size):
    reqs = workload()
    server = DisaggregatedServer(MODEL, max_batch_size=3, block_size=block_size, link_bytes_per_s=1e8)
    got = server.run(reqs)
    assert [c.output_ids for c in got] == [reference(MODEL, r.prompt, r.max_new_tokens) for r in reqs]
    handed = [r for r, c in zip(reqs, got) if r.max_new_tokens > 1 and c.output_ids[0] != EOS]
    per_token = server.prefill.kv.pool.bytes_per_token
    assert server.transfers["requests"] == len(handed)
    assert server.transfers["bytes"] == sum(math.ceil(len(r.prompt) / block_size) * block_size * per_token
                                            for r in handed)
    assert server.transfers["seconds"] == pytest.approx(server.transfers["bytes"] / 1e8)
    for e in (server.prefill, server.decode):
        assert e.kv_usage()["num_free_blocks"] == e.kv.num_blocks and not getattr(e.kv, "swap_space", None)
    for c in got:  # simulated times are consistent
        assert c.arrival_time <= c.first_token_time <= c.token_times[-1] == c.finish_time


def test_a_slow_link_delays_the_second_token_by_the_transfer_time():
    r = Request(list(range(6, 38)), 3, request_id="x")
    fast = DisaggregatedServer(MODEL, max_batch_size=1, block_size=4, link_bytes_per_s=1e12).run([r])[0]
    slow_server = DisaggregatedServer(MODEL, max_batch_size=1, block_size=4, link_bytes_per_s=1e4)
    slow = slow_server.run([Request(list(range(6, 38)), 3, request_id="x")])[0]
    assert slow.output_ids == fast.output_ids
    gap = slow.token_times[1] - slow.token_times[0]
    assert gap >= slow_server.transfers["seconds"] > 1.0  # 32 tokens of K/V over 10 kB/s


def test_colocated_engine_on_a_virtual_clock_for_comparison():
    reqs = workload(1)
    eng = Engine(MODEL, max_batch_size=3, kv="paged", clock=VirtualClock())
    got = eng.run(reqs)
    assert [c.output_ids for c in got] == [reference(MODEL, r.prompt, r.max_new_tokens) for r in reqs]
    s = summarize(got)
    assert s["ttft_p50"] >= 0 and s["num_completed"] == len(reqs)


def test_bad_link_and_requests_that_cannot_fit_the_decode_pool_are_refused():
    with pytest.raises(ValueError, match="link_bytes_per_s"):
        DisaggregatedServer(MODEL, link_bytes_per_s=0)
    server = DisaggregatedServer(MODEL, max_batch_size=1, block_size=4, decode_options={"num_blocks": 3})
    with pytest.raises(ValueError, match="KV blocks"):
        server.run([Request(list(range(6, 20)), 10)])


def test_each_phase_can_be_sized_on_its_own():
    server = DisaggregatedServer(MODEL, max_batch_size=2, block_size=4,
                                 prefill_options={"max_batch_size": 1, "token_budget": 16},
                                 decode_options={"max_batch_size": 4, "num_blocks": 40})
    assert server.prefill.scheduler.max_batch_size == 1 and server.decode.scheduler.max_batch_size == 4
    reqs = workload(2, n=5)
    got = server.run(reqs)
    assert [c.output_ids for c in got] == [reference(MODEL, r.prompt, r.max_new_tokens) for r in reqs]


@pytest.mark.parametrize("options, message", [
    (dict(prefill_options=dict(kv="concat")), r"prefill_options may not set \['kv'\]"),
    (dict(decode_options=dict(clock=None)), r"decode_options may not set \['clock'\]"),
    (dict(prefill_options=[1]), "prefill_options must be a dict"),
    (dict(decode_options=dict(block_size=8)), "the same block_size"),
    (dict(prefill_options=dict(kv_dtype="int8")), "the same kv_dtype"),
    (dict(link_bytes_per_s=True), "link_bytes_per_s must be a finite number"),
])
def test_pools_that_cannot_hand_over_are_refused_up_front(options, message):
    with pytest.raises(ValueError, match=message):
        DisaggregatedServer(MODEL, max_batch_size=2, block_size=4, **options)


def test_a_second_run_counts_arrivals_from_its_own_start():
    server = DisaggregatedServer(MODEL, max_batch_size=2, block_size=4, step_time=0.01)  # 0.01 s a step, any machine
    server.run([Request([7, 8, 9], 5, request_id=i, arrival_time=1.0 * i) for i in range(3)])
    again = [Request([7, 8, 9], 5, request_id=("b", i), arrival_time=0.1 * i) for i in range(2)]
    got = server.run(again)
    assert [c.output_ids for c in got] == [reference(MODEL, r.prompt, 5) for r in again]
    assert all(0 <= c.first_token_time - c.arrival_time < 0.5 for c in got)  # not the first run's 2 s
    both_int8 = DisaggregatedServer(MODEL, max_batch_size=2, block_size=4, prefill_options=dict(kv_dtype="int8"),
                                    decode_options=dict(kv_dtype="int8"))
    assert len(both_int8.run([Request([7, 8, 9], 4)])[0].output_ids) == 4


def test_a_request_that_stops_on_its_first_token_is_not_handed_over():
    """A stop token as the first greedy token ended the request in the prefill engine, yet it was handed over and
    decoded on until the token came up again (only EOS was looked at)."""
    model = tiny_model("llama")
    first = reference(model, [7, 8, 9], 1, eos_id=None)[0]
    req = lambda: Request([7, 8, 9], 6, request_id="s", sampling_params=SamplingParams(stop_token_ids=[first]))  # noqa: E731
    want = Engine(model, max_batch_size=2, kv="paged").run([req()])[0]
    got = DisaggregatedServer(model, max_batch_size=2).run([req()])[0]
    assert (got.output_ids, got.finish_reason) == (want.output_ids, want.finish_reason) == ([first], "stop")


@pytest.mark.parametrize("options", [dict(async_scheduling=True), dict(parallel_sampling="fork"),
                                     dict(tensor_parallel_size=2)])
def test_options_a_handover_cannot_take_are_refused_when_the_server_is_built(options):
    """They were taken, and the first handover failed inside the prefill engine's step (blocks held, a request
    lost; with tensor parallelism, after two worker processes had started)."""
    model = tiny_model("llama")
    for phase in ("prefill_options", "decode_options"):
        with pytest.raises(ValueError, match="do not go with disaggregation"):
            DisaggregatedServer(model, max_batch_size=2, **{phase: options})


def test_a_decode_scheduler_that_cannot_take_a_handover_is_refused_when_the_server_is_built():
    """V1's scheduler (or a learner's subclass of it) was taken for the decode engine; the first handover raised
    inside the prefill engine's step, its blocks held. A V0Scheduler subclass is taken."""
    from cbteach.engine.scheduler import Scheduler
    from cbteach.engine.scheduler_v0 import V0Scheduler

    model = tiny_model("llama")
    with pytest.raises(ValueError, match="decode_options scheduler_cls='Scheduler'.*V0Scheduler"):
        DisaggregatedServer(model, max_batch_size=2, decode_options={"scheduler_cls": Scheduler})

    class Mine(V0Scheduler):
        pass

    got = DisaggregatedServer(model, max_batch_size=2, decode_options={"scheduler_cls": Mine}).run(
        [Request([7, 8, 9], 5, request_id="m")])
    assert got[0].output_ids == reference(model, [7, 8, 9], 5)


def test_each_phase_is_sized_for_what_it_holds_and_a_refusal_names_the_phase():
    """The prefill pool was checked against the whole request although it only ever holds the prompt and its
    first token, so sizing the two phases apart (DistServe's point) refused what fits; a request too big for a
    pool is refused naming the phase."""
    model = tiny_model("llama")
    server = DisaggregatedServer(model, max_batch_size=2, block_size=4, prefill_options={"num_blocks": 4},
                                 decode_options={"num_blocks": 40})
    r = Request(list(range(10, 18)), 20, request_id="x")  # 8 + 1 tokens prefill (3 blocks), 28 in all (7)
    assert server.run([r])[0].output_ids == reference(model, r.prompt, 20)
    assert server.prefill.kv_usage()["num_used_blocks"] == server.decode.kv_usage()["num_used_blocks"] == 0
    with pytest.raises(ValueError, match=r"KV blocks.*\(the prefill engine's pool: prefill_options\)"):
        server.run([Request(list(range(10, 30)), 2, request_id="long")])
    with pytest.raises(ValueError, match=r"KV blocks.*\(the decode engine's pool: decode_options\)"):
        server.run([Request(list(range(10, 18)), 200, request_id="far")])
