"""vLLM's own scheduler tests, as a check of any cbteach scheduler: "your scheduler passes N of vLLM's M".

Ported from vLLM V1's ``tests/v1/core/test_scheduler.py`` at vllm-project/vllm@003df29, on :mod:`.vllm_harness`'s
stage: each keeps vLLM's scenario and assertions, quoted in V1's words when one fails; tests of one shape are one
function run on a table of cases. Ported (25, each parametrization counted): ``test_schedule`` (prefix caching off
and on), ``test_schedule_order`` (chunked prefill on), ``test_stop_via_update_from_output``,
``test_schedule_spec_decoding_stats`` (6 cases), ``test_no_spec_tokens_scheduled_for_prefill_chunks``,
``test_spec_decode_padding_skipped_for_diffusion``, ``test_memory_leak``, twelve priority tests (:data:`PRIORITY_TESTS`).

Left out, and why: ``test_add_requests``, ``test_finish_request``, ``test_get_num_unfinished_requests`` --
bookkeeping a learner inherits; ``test_schedule_order`` without chunked prefill,
``test_schedule_concurrent_partial_requests``, ``test_schedule_prefills_gating``, ``test_throttle_*``,
``test_schedule_skip_tokenizer_init`` -- V1 options cbteach lacks; ``test_schedule_concurrent_batches``,
``test_preempt_during_execution``, ``test_async_scheduling_pp_allows_rescheduling_with_output_placeholders`` --
pipeline parallelism's two plans in flight; ``test_spec_decoding_stats_empty_output`` (cbteach reports a failure in
``output.errors``), ``test_spec_decode_padding_first_decode_step`` and ``..._skipped_with_prefill_in_batch`` (cbteach
never pads guesses); ``test_check_stop_min_tokens`` (no ``min_tokens``); ``test_scheduler_reset_prefix_cache``,
``test_prefix_cache_*``, ``test_scheduler_stats_*`` -- V1's KV manager's counters; multimodal, encoder,
structured-output, EAGLE, Mamba and connector tests, ``test_cached_request_data_resumed_all_token_ids_mrv1_only``
(V1's private runner switch) -- machinery the course's engine does not have.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..core.request import RequestStatus
from ..engine.scheduler import Scheduler
from . import fail, guard, raised, self_check
from .vllm_harness import EOS_TOKEN_ID, VLLM_COMMIT, VLLM_FILE, Harness, VLLMAssertion, expect


def test_schedule(cls, enable_prefix_caching):
    h = Harness(cls, enable_prefix_caching=enable_prefix_caching)
    requests = h.add_request(*h.create_requests(num_requests=10))
    output = h.schedule()
    h.counts(output, new=len(requests), cached=0, finished=0)
    for req_id, num_tokens in output.num_scheduled_tokens.items():
        expect("num_tokens == len(requests[int(req_id)].prompt_token_ids)", num_tokens,
               len(requests[int(req_id)].prompt_ids))
    h.counts(output, waiting=0, running=len(requests))
    expect("scheduler.running[i] == request (for each i)", h.ids(h.scheduler.running), h.ids(requests))


def test_schedule_order(cls):
    h = Harness(cls, max_num_batched_tokens=1024, max_num_seqs=3)
    h.add_request(*h.create_requests(2, num_tokens=800, req_ids=["1", "2"]),  # long requests
                  *h.create_requests(2, num_tokens=10, req_ids=["3", "4"]))  # short requests
    h.counts(h.schedule(), "scheduler_output1", new=2)  # with chunked prefill, long requests will be chunked


# test_stop_via_update_from_output's cases, vLLM's "Test case 1" to 4: the requests' options, each request's
# guesses and sampled tokens; then how request 0 finished (None: it goes on) and each request's output_token_ids
STOP_CASES = {
    "Stop on EOS token": (dict(max_tokens=10), [[], [10]], [[EOS_TOKEN_ID], [10, 11]], "eos",
                          [[EOS_TOKEN_ID], [10, 11]]),
    "Stop on custom stop token": (dict(max_tokens=10, stop_token_ids=[42, 43]), [[10, 42], [13]],
                                  [[10, 42, 12], [13, 14]], "stop", [[10, 42], [13, 14]]),
    "Stop on max tokens": (dict(max_tokens=2), [[10, 11], []], [[10, 11, 12], [13]], "length", [[10, 11], [13]]),
    "Ignore EOS flag": (dict(max_tokens=10, ignore_eos=True), [[EOS_TOKEN_ID, 10]], [[EOS_TOKEN_ID, 10, 11]], None,
                        [[EOS_TOKEN_ID, 10, 11]]),
}
STOPPED = {"eos": "requests[0].status == RequestStatus.FINISHED_STOPPED", "stop": "requests[0].stop_reason == 42",
           "length": "requests[0].status == RequestStatus.FINISHED_LENGTH_CAPPED", None: "not requests[0].is_finished()"}


def test_stop_via_update_from_output(cls):
    for options, spec, sampled, reason, outputs in STOP_CASES.values():
        h = Harness(cls)
        requests = h.create_requests(num_requests=len(sampled), **options)
        ids = h.ids(requests)
        h.update(h.running_after_schedule(requests, dict(zip(ids, spec))), dict(zip(ids, sampled)))
        h.counts(running=1)
        if len(requests) > 1:
            expect("scheduler.running[0].request_id == requests[1].request_id", h.ids(h.scheduler.running), ["1"])
        expect(STOPPED[reason], (requests[0].status.is_finished, requests[0].finish_reason),
               (reason is not None, reason), "finished?, finish_reason")
        if reason == "eos":
            expect("requests[0].request_id in scheduler.finished_req_ids", "0" in h.scheduler.finished_req_ids)
        for i, want in enumerate(outputs):
            said = str(want).replace(str(EOS_TOKEN_ID), "EOS_TOKEN_ID")
            expect(f"list(requests[{i}].output_token_ids) == {said}", requests[i].output_ids, want)


# test_schedule_spec_decoding_stats's cases ("mirror some of those in test_rejection_sampler.py"): each request's
# guesses, the tokens the model samples to check them, and the STATS expected
STATS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")
SPEC_CASES = {
    "perfect match": ([[1, 2, 3]], [[1, 2, 3, 4]], (1, 3, 3, [1, 1, 1])),
    "early mismatch": ([[1, 2, 3]], [[1, 5]], (1, 3, 1, [1, 0, 0])),
    "multiple sequences": ([[1, 2], [3]], [[1, 2, 5], [3, 4]], (2, 3, 3, [2, 1])),
    "single token sequence": ([[1]], [[1, 2]], (1, 1, 1, [1])),
    "empty sequence": ([[]], [[5]], (0, 0, 0, [0])),
    "multiple mismatches": ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7], [4, 8]], (2, 6, 3, [2, 1, 0])),
}


def test_schedule_spec_decoding_stats(cls, case):
    spec_tokens, output_tokens, expected = case
    h = Harness(cls)
    requests = h.add_request(*h.create_requests(num_requests=len(spec_tokens), num_tokens=1))
    req_ids = h.ids(requests)
    output = h.schedule()  # a decode, which will also draft speculative tokens
    h.counts(output, new=len(requests))
    expect("output.total_num_scheduled_tokens == len(requests)", output.total_num_scheduled_tokens, len(requests))
    for req_id in req_ids:
        expect("output.num_scheduled_tokens[req_id] == 1", output.num_scheduled_tokens.get(req_id), 1)
        expect("req_id not in output.scheduled_spec_decode_tokens", req_id not in output.scheduled_spec_decode_tokens)
    h.update(output, {r: [0] for r in req_ids})
    h.update_draft_token_ids(req_ids, spec_tokens)
    for i, running_req in enumerate(h.scheduler.running):
        expect("running_req.num_computed_tokens == 1", running_req.num_computed_tokens, 1, "the prompt token")
        expect("running_req.num_tokens == 2", running_req.num_tokens, 2, "the prompt token and the sampled token")
        expect("running_req.num_tokens_with_spec == 2 + len(spec_tokens[i])", running_req.num_tokens
               + len(running_req.draft_ids), 2 + len(spec_tokens[i]), "num_tokens + len(draft_ids)")
    output = h.schedule()  # the speculated tokens, for validation
    h.counts(output, new=0)
    expect("output.total_num_scheduled_tokens == len(requests) + sum(len(ids) for ids in spec_tokens)",
           output.total_num_scheduled_tokens, len(requests) + sum(len(ids) for ids in spec_tokens))
    guesses = output.scheduled_spec_decode_tokens
    for req_id, spec in zip(req_ids, spec_tokens):
        expect("output.num_scheduled_tokens[req_id] == 1 + len(spec_tokens[i])", output.num_scheduled_tokens.get(req_id),
               1 + len(spec))
        if spec:
            expect("len(output.scheduled_spec_decode_tokens[req_id]) == len(spec_tokens[i])",
                   len(guesses.get(req_id, ())), len(spec))
        else:
            expect("req_id not in output.scheduled_spec_decode_tokens", req_id not in guesses)
    h.update(output, dict(zip(req_ids, output_tokens)))
    accepted = [s.num_computed_tokens - 2 for s in requests]  # past the prompt and the token before the guesses
    stats = (len(guesses), sum(map(len, guesses.values())), sum(accepted),
             [sum(a > j for a in accepted) for j in range(max(1, *map(len, spec_tokens)))])
    for k, name in enumerate(STATS):
        expect(f"stats.{name} == expected[{k}]", stats[k], expected[k],
               "accepted guesses: how far num_computed_tokens moved past the token before them")


def test_no_spec_tokens_scheduled_for_prefill_chunks(cls):
    h = Harness(cls, max_num_batched_tokens=50)  # num_speculative_tokens=3; an 80-token prompt
    (req,) = h.add_request(*h.create_requests(num_requests=1, num_tokens=80))
    output = h.schedule()  # a prefill chunk, 50 of 80 tokens
    h.counts(output, new=1)
    expect("output.num_scheduled_tokens[req.request_id] == 50", output.num_scheduled_tokens.get("0"), 50)
    h.update(output, {"0": []})  # no sampled token: still prefilling
    h.update_draft_token_ids(["0"], [[1, 2, 3]])  # ignored for a prefill chunk
    output = h.schedule()
    expect("output.num_scheduled_tokens[req.request_id] == 30", output.num_scheduled_tokens.get("0"), 30,
           "the remaining prefill only, no guesses")
    expect("req.request_id not in output.scheduled_spec_decode_tokens", "0" not in output.scheduled_spec_decode_tokens)
    h.update(output, {"0": [42]})  # prefill complete
    h.update_draft_token_ids(["0"], [[1, 2, 3]])
    expect("req.spec_token_ids == [1, 2, 3]", req.draft_ids, [1, 2, 3], "seq.draft_ids")
    output = h.schedule()
    expect("output.num_scheduled_tokens[req.request_id] == 4", output.num_scheduled_tokens.get("0"), 4,
           "1 new token + 3 spec tokens")
    expect("len(output.scheduled_spec_decode_tokens[req.request_id]) == num_spec_tokens",
           len(output.scheduled_spec_decode_tokens.get("0", ())), 3)


def test_spec_decode_padding_skipped_for_diffusion(cls):
    h = Harness(cls, enable_prefix_caching=True, block_size=16)  # num_speculative_tokens=3, nothing padded
    r1, r2 = h.create_requests(num_requests=2, num_tokens=33, same_prompt=True, max_tokens=16)
    h.add_request(r1)
    out = h.schedule()
    expect("out.num_scheduled_tokens[r1.request_id] == 33", out.num_scheduled_tokens.get("0"), 33)
    h.update(out, {"0": [100]})
    h.update_draft_token_ids(["0"], [[1, 2, 3]])
    h.add_request(r2)  # its whole prompt but the last token is a prefix-cache hit
    out = h.schedule()
    expect("out.scheduled_spec_decode_tokens[r1.request_id] == [1, 2, 3]", out.scheduled_spec_decode_tokens.get("0"),
           [1, 2, 3])
    expect("out.num_scheduled_tokens[r2.request_id] == 1", out.num_scheduled_tokens.get("1"), 1,
           "r2 keeps its true 1-token span: two full blocks of its 33-token prompt are cached")
    expect("r2.request_id not in out.scheduled_spec_decode_tokens", "1" not in out.scheduled_spec_decode_tokens)


def test_memory_leak(cls):
    h = Harness(cls, enable_prefix_caching=True)
    for request in h.create_requests(num_requests=5, num_tokens=10, max_tokens=10):
        h.add_request(request)
        out = h.schedule()
        h.update(out, {r: [1000] for r in out.num_scheduled_tokens})
    for _ in range(100):  # iterate until done (V1's loop has no bound; a stuck scheduler would hang it)
        out = h.schedule()
        if not h.scheduler.running:
            break
        h.update(out, {r: [1000] for r in out.num_scheduled_tokens})
    for name in ("requests", "waiting", "running", "finished_req_ids"):
        expect(f"len(scheduler.{name}) == 0", len(getattr(h.scheduler, name)), 0, "no leaks")
    expect("num_free_blocks == (scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1)", h.kv.num_free_blocks,
           h.num_blocks - 1, "every block back")


# -- the priority tests, on a scheduler made as create_scheduler_with_priority makes one (a smaller number is more
# urgent, ties go to the earlier arrival); the preemption-and-resumption test runs without its KV and EC connectors

def _first_step_case(cls, priorities, arrival_times, first, waiting=None, **options):
    """The priority tests of one shape: requests of ``priorities`` arrive, one step is planned and admits ``first``
    (in that order; with ``waiting``, in any order and the rest waits in the queue's order, ``waiting``)."""
    h = Harness(cls, policy="priority", **options)
    h.add_request(*h.create_requests(len(priorities), priorities=priorities, arrival_times=arrival_times))
    output = h.schedule()
    h.counts(output, new=len(first))
    scheduled = [r.req_id for r in output.scheduled_new_reqs]
    if waiting is None:
        expect(f"scheduled_req_ids == {first}", scheduled, first, "should schedule all requests since they fit in budget")
        return
    expect(f"scheduled request ids == {first}", sorted(scheduled), sorted(first))
    h.counts(output, waiting=len(waiting))
    expect(f"waiting_req_ids == {waiting}", h.ids(h.scheduler.waiting), waiting,
           "iterating the waiting queue gives the policy's order")


def test_priority_scheduling_preemption(cls):
    """Under KV block pressure the lowest-priority *running* request is preempted, not the highest."""
    h = Harness(cls, policy="priority", max_num_seqs=3, max_num_batched_tokens=200, num_blocks=6,
                block_size=16)  # 5 usable blocks
    h.add_request(*h.create_requests(1, num_tokens=32, priorities=[5], arrival_times=[1.0], req_ids=["lo1"]))
    output = h.schedule()
    h.counts(output, new=1)
    h.update(output, {"lo1": [100]})  # lo1 now has 33 tokens
    h.add_request(*h.create_requests(1, num_tokens=32, priorities=[0], arrival_times=[2.0], req_ids=["hi1"]))
    output = h.schedule()  # lo1 gets its 3rd block, hi1 is admitted: 5 used, 0 free
    expect('any(r.req_id == "hi1" for r in output.scheduled_new_reqs)',
           any(r.req_id == "hi1" for r in output.scheduled_new_reqs))
    h.counts(output, running=2)
    h.update(output, {"lo1": [101], "hi1": [100]})
    h.schedule()  # hi1 needs a 3rd block, none is free: max(running, key=(priority, arrival_time)) is lo1
    expect("lo1_req.status == RequestStatus.PREEMPTED", h.scheduler.requests["lo1"].status, RequestStatus.PREEMPTED,
           "Expected low-priority 'lo1' to be preempted")
    expect('any(req.request_id == "hi1" for req in scheduler.running)', "hi1" in h.ids(h.scheduler.running),
           True, "High-priority 'hi1' should still be running")


def test_priority_scheduling_no_preemption_when_space_available(cls):
    h = Harness(cls, policy="priority", max_num_seqs=3, max_num_batched_tokens=200)
    h.add_request(*h.create_requests(2, num_tokens=30, priorities=[5, 5], arrival_times=[1.0, 2.0],
                                     req_ids=["lo1", "lo2"]))
    h.update(h.schedule(), {"lo1": [100], "lo2": [100]})
    h.add_request(*h.create_requests(1, num_tokens=30, priorities=[0], arrival_times=[3.0], req_ids=["hi1"]))
    h.counts(h.schedule(), new=1, running=3, waiting=0)  # should not preempt since there's space


def test_priority_scheduling_heap_property(cls):
    priorities = [5, 1, 8, 3, 2, 7, 4, 6]
    h = Harness(cls, policy="priority", max_num_seqs=1)
    requests = h.add_request(*h.create_requests(len(priorities), priorities=priorities,
                                                arrival_times=[float(i) for i in range(len(priorities))]))
    scheduled = []
    for _ in range(4 * len(priorities)):  # `while scheduler.waiting:`, bounded
        if not len(h.scheduler.waiting):
            break
        output = h.schedule()
        if output.scheduled_new_reqs:
            req = output.scheduled_new_reqs[0]
            scheduled.append(requests[int(req.req_id)].request.priority)
            h.update(output, {req.req_id: [100]})
            h.finish_requests(h.scheduler.requests[req.req_id])  # to make room for the next one
    expect("scheduled_priorities == expected_priorities", scheduled, sorted(priorities), "lowest value first")


def test_priority_scheduling_preemption_and_resumption_when_out_of_kv(cls):
    h = Harness(cls, policy="priority", max_num_seqs=2, max_num_batched_tokens=200, num_blocks=5, block_size=16)
    (low,) = h.add_request(*h.create_requests(1, num_tokens=30, priorities=[1], arrival_times=[0.0]))
    output = h.schedule()  # 1st schedule; room for 64 tokens
    h.counts(output, new=1, running=1)
    h.update(output, {low.request_id: [100]})
    (high,) = h.add_request(*h.create_requests(1, num_tokens=32, priorities=[0], arrival_times=[1.0], starting_idx=1))
    output = h.schedule()  # 2nd schedule: the KV cache is full
    expect("scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 0", h.kv.num_free_blocks, 0)
    h.counts(output, new=1, cached=1, running=2)
    h.update(output, {low.request_id: [100], high.request_id: [100]})
    output = h.schedule()  # 3rd schedule: low needs 32 tokens, high 33 -- 5 blocks, and 4 fit
    h.counts(output, new=0)
    expect("output.scheduled_cached_reqs.req_ids[0] == request_high.request_id",
           output.scheduled_cached_reqs.req_ids[:1], [high.request_id])
    expect("scheduler.requests[request_low.request_id].status == RequestStatus.PREEMPTED", low.status,
           RequestStatus.PREEMPTED)
    h.counts(output, cached=1, waiting=1, running=1)
    h.update(output, {low.request_id: [], high.request_id: [100]})
    h.finish_requests(high)  # to make room for the preempted request to resume
    output = h.schedule()  # 4th schedule: the resumption
    h.counts(output, waiting=0, running=1, new=0)
    resumed = output.scheduled_cached_reqs
    expect("scheduled_cached_reqs.req_ids[0] == request_low.request_id", resumed.req_ids[:1], [low.request_id])
    expect("request_low.request_id in scheduled_cached_reqs.resumed_req_ids", low.request_id in resumed.resumed_req_ids)
    expect("len(scheduled_cached_reqs.all_token_ids[request_low.request_id]) == 32",
           len(resumed.all_token_ids.get(low.request_id, ())), 32,
           "resumed tokens include 30 prompt tokens and 2 decoded tokens")


def _first_step(**case):
    return _first_step_case, case


# vLLM's tests in its order, name -> (the test, its arguments besides cls); most differ only in their requests'
# priorities and arrival times, the ids the first step admits and (when some must wait) the ids left waiting
PRIORITY_TESTS = {f"test_priority_scheduling_{name}": case for name, case in {
    "basic_ordering": _first_step(priorities=[2, 0, 1], arrival_times=[1.0, 2.0, 3.0], first=["1", "2", "0"]),
    "arrival_time_tiebreaker": _first_step(priorities=[1, 1, 1], arrival_times=[3.0, 1.0, 2.0], first=["1", "2", "0"]),
    "mixed_priority_and_arrival": _first_step(priorities=[2, 1, 1, 0], arrival_times=[1.0, 3.0, 2.0, 4.0],
                                              first=["3", "2", "1", "0"]),
    "preemption": (test_priority_scheduling_preemption, {}),
    "no_preemption_when_space_available": (test_priority_scheduling_no_preemption_when_space_available, {}),
    "preemption_victim_selection": _first_step(priorities=[3, 2, 0], arrival_times=[1.0, 2.0, 3.0], first=["2"],
                                               waiting=["1", "0"], max_num_seqs=1),
    "equal_priority_preemption": _first_step(priorities=[2, 2, 2], arrival_times=[3.0, 1.0, 2.0], first=["1"],
                                             waiting=["2", "0"], max_num_seqs=1),
    "waiting_queue_order": _first_step(priorities=[3, 1, 2, 0], arrival_times=[1.0, 2.0, 3.0, 4.0], first=["3"],
                                       waiting=["1", "2", "0"], max_num_seqs=1),
    "fcfs_fallback": _first_step(priorities=[1, 1, 1, 1], arrival_times=[4.0, 1.0, 3.0, 2.0],
                                 first=["1", "3", "2", "0"]),
    "with_limited_slots": _first_step(priorities=[3, 1, 2, 0], arrival_times=[1.0, 2.0, 3.0, 4.0], first=["3", "1"],
                                      waiting=["2", "0"], max_num_seqs=2, max_num_batched_tokens=1000),
    "heap_property": (test_priority_scheduling_heap_property, {}),
    "preemption_and_resumption_when_out_of_kv": (test_priority_scheduling_preemption_and_resumption_when_out_of_kv, {}),
}.items()}
TESTS = {"test_schedule[prefix caching off]": (test_schedule, {"enable_prefix_caching": False}),
         "test_schedule[prefix caching on]": (test_schedule, {"enable_prefix_caching": True}),
         "test_schedule_order[chunked prefill]": (test_schedule_order, {}),
         "test_stop_via_update_from_output": (test_stop_via_update_from_output, {}),
         **{f"test_schedule_spec_decoding_stats[{name}]": (test_schedule_spec_decoding_stats, {"case": case})
            for name, case in SPEC_CASES.items()},
         **{f.__name__: (f, {}) for f in (test_no_spec_tokens_scheduled_for_prefill_chunks,
                                          test_spec_decode_padding_skipped_for_diffusion, test_memory_leak)},
         **PRIORITY_TESTS}  # name -> (test, its arguments besides cls)


@dataclass
class Report:
    """Which of vLLM's ported tests a scheduler class passes; for each failure, vLLM's words."""

    passed: list = field(default_factory=list)
    failed: dict = field(default_factory=dict)  # test -> what vLLM asserts (or what stopped the test)
    delegated: str | None = None  # the guard's refusal: the scheduler is or calls the engine's own scheduling

    def __str__(self) -> str:
        n, m = len(self.passed), len(self.passed) + len(self.failed)
        lines = [f"your scheduler passes {n} of vLLM's {m} ported scheduler tests "
                 f"(vllm-project/vllm@{VLLM_COMMIT[:7]}, {VLLM_FILE})"]
        if not self.failed:  # several wrong schedulers pass them all: notebook 06's stages carry the load
            lines.append("  (a second opinion, not a proof: wrong schedulers can pass all of these -- notebook 06's "
                         "stages are the check of yours)")
        if self.delegated:
            lines.append(f"  !! {self.delegated}: these results are the engine's")
        stubbed: dict = {}  # a method not written yet stops every test that calls it: one line for them all
        for name, why in self.failed.items():
            if "not done yet" in why:
                stubbed.setdefault(why, []).append(name)
            else:
                lines.append(f"  ✗ {name}: {why}")
        lines += [f"  ✗ {names[0]}{f' and {len(names) - 1} more' if len(names) > 1 else ''}: {why}"
                  for why, names in stubbed.items()]
        return "\n".join(lines)


def run(scheduler_cls, update_cls=None) -> Report:
    """Every ported test on ``scheduler_cls`` (with ``update_cls``'s ``update_from_output``, if given:
    notebook 06's ``MyScheduler`` and ``MyUpdate``)."""
    cls = scheduler_cls
    if update_cls is not None and not issubclass(scheduler_cls, update_cls):
        cls = update_cls if issubclass(update_cls, scheduler_cls) else \
            type(scheduler_cls.__name__, (scheduler_cls, update_cls), {})
    result = Report()
    for name, (test, kwargs) in TESTS.items():
        try:
            test(cls, **kwargs)
        except VLLMAssertion as err:
            result.failed[name] = str(err)
        except Exception as err:  # noqa: BLE001 -- the scheduler under test raised
            result.failed[name] = f"the test stopped before vLLM's assertions held: {raised(err)}"
        else:
            result.passed.append(name)
    written = [m for m in ("schedule", "update_from_output") if getattr(cls, m) is not getattr(Scheduler, m)]
    result.delegated = guard.refusal("scheduler", cls, written) if written else None
    return result


@self_check
def check_vllm_tests(scheduler_cls, update_cls=None) -> bool:
    """Print how many of vLLM's ported tests ``scheduler_cls`` (and ``update_cls``) pass, each failure
    with vLLM's assertion; True when every one passes."""
    if scheduler_cls is None:
        return fail("not done yet: write your scheduler class, then run this check")
    for cls in (scheduler_cls, update_cls):
        if cls is not None and not (isinstance(cls, type) and issubclass(cls, Scheduler)):
            return fail(f"pass your classes themselves, subclasses of Scheduler (got {type(cls).__name__}): "
                        "not done yet?")
    result = run(scheduler_cls, update_cls)
    print(result)
    return not result.failed and not result.delegated
