"""vLLM's priority-scheduling tests, ported (see :mod:`.vllm_scheduler_tests`): the scheduler made as
``create_scheduler_with_priority`` makes one (a smaller number is more urgent, ties go to the earlier arrival).
The preemption-and-resumption test runs without its KV and EC connectors.
"""
from __future__ import annotations

from ..core.request import RequestStatus
from .vllm_harness import Harness, expect


def _priority(cls, **kwargs) -> Harness:
    return Harness(cls, policy="priority", **kwargs)


def _order_case(cls, priorities, arrival_times, want):
    h = _priority(cls)
    requests = h.create_requests(len(priorities), priorities=priorities, arrival_times=arrival_times)
    h.add_request(*requests)
    output = h.schedule()
    expect(f"len(output.scheduled_new_reqs) == {len(want)}", len(output.scheduled_new_reqs), len(want),
           "should schedule all requests since they fit in budget")
    expect(f"scheduled_req_ids == {want}", [r.req_id for r in output.scheduled_new_reqs], want)


def test_priority_scheduling_preemption(cls):
    """Under KV block pressure the lowest-priority *running* request is preempted, not the highest."""
    h = _priority(cls, max_num_seqs=3, max_num_batched_tokens=200, num_blocks=6, block_size=16)  # 5 usable blocks
    (lo1,) = h.create_requests(1, num_tokens=32, priorities=[5], arrival_times=[1.0], req_ids=["lo1"])
    h.add_request(lo1)
    output = h.schedule()
    expect("len(output.scheduled_new_reqs) == 1", len(output.scheduled_new_reqs), 1)
    h.update(output, {"lo1": [100]})  # lo1 now has 33 tokens
    (hi1,) = h.create_requests(1, num_tokens=32, priorities=[0], arrival_times=[2.0], req_ids=["hi1"])
    h.add_request(hi1)
    output = h.schedule()  # lo1 gets its 3rd block, hi1 is admitted: 5 used, 0 free
    expect('any(r.req_id == "hi1" for r in output.scheduled_new_reqs)',
           any(r.req_id == "hi1" for r in output.scheduled_new_reqs))
    expect("len(scheduler.running) == 2", len(h.scheduler.running), 2)
    h.update(output, {"lo1": [101], "hi1": [100]})
    h.schedule()  # hi1 needs a 3rd block, none is free: max(running, key=(priority, arrival_time)) is lo1
    expect("lo1_req.status == RequestStatus.PREEMPTED", h.scheduler.requests["lo1"].status, RequestStatus.PREEMPTED,
           "Expected low-priority 'lo1' to be preempted")
    expect('any(req.request_id == "hi1" for req in scheduler.running)', "hi1" in h.ids(h.scheduler.running),
           True, "High-priority 'hi1' should still be running")


def test_priority_scheduling_no_preemption_when_space_available(cls):
    h = _priority(cls, max_num_seqs=3, max_num_batched_tokens=200)
    low = h.create_requests(2, num_tokens=30, priorities=[5, 5], arrival_times=[1.0, 2.0], req_ids=["lo1", "lo2"])
    h.add_request(*low)
    output = h.schedule()
    h.update(output, {"lo1": [100], "lo2": [100]})
    (high,) = h.create_requests(1, num_tokens=30, priorities=[0], arrival_times=[3.0], req_ids=["hi1"])
    h.add_request(high)
    output = h.schedule()  # should not preempt since there's space
    expect("len(output.scheduled_new_reqs) == 1", len(output.scheduled_new_reqs), 1)
    expect("len(scheduler.running) == 3  # All three requests running", len(h.scheduler.running), 3)
    expect("len(scheduler.waiting) == 0  # No requests waiting", len(h.scheduler.waiting), 0)


def _one_slot_case(cls, priorities, arrival_times, first, waiting_ids, max_num_seqs=1, max_num_batched_tokens=8192):
    h = _priority(cls, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    requests = h.create_requests(len(priorities), priorities=priorities, arrival_times=arrival_times)
    h.add_request(*requests)
    output = h.schedule()
    expect(f"len(output.scheduled_new_reqs) == {len(first)}", len(output.scheduled_new_reqs), len(first))
    expect(f"scheduled request ids == {first}", sorted(r.req_id for r in output.scheduled_new_reqs), sorted(first))
    expect(f"len(scheduler.waiting) == {len(waiting_ids)}", len(h.scheduler.waiting), len(waiting_ids))
    expect(f"waiting_req_ids == {waiting_ids}", [r.request_id for r in h.scheduler.waiting], waiting_ids,
           "iterating the waiting queue gives the policy's order")


def test_priority_scheduling_heap_property(cls):
    priorities = [5, 1, 8, 3, 2, 7, 4, 6]
    h = _priority(cls, max_num_seqs=1)
    requests = h.create_requests(len(priorities), priorities=priorities,
                                 arrival_times=[float(i) for i in range(len(priorities))])
    h.add_request(*requests)
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
    h = _priority(cls, max_num_seqs=2, max_num_batched_tokens=200, num_blocks=5, block_size=16)  # 64 tokens
    (low,) = h.create_requests(1, num_tokens=30, priorities=[1], arrival_times=[0.0], starting_idx=0)
    h.add_request(low)
    output = h.schedule()  # 1st schedule
    expect("len(output.scheduled_new_reqs) == 1", len(output.scheduled_new_reqs), 1)
    expect("len(scheduler.running) == 1", len(h.scheduler.running), 1)
    h.update(output, {low.request_id: [100]})
    (high,) = h.create_requests(1, num_tokens=32, priorities=[0], arrival_times=[1.0], starting_idx=1)
    h.add_request(high)
    output = h.schedule()  # 2nd schedule: the KV cache is full
    expect("scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 0", h.kv.num_free_blocks, 0)
    expect("len(output.scheduled_new_reqs) == 1", len(output.scheduled_new_reqs), 1)
    expect("output.scheduled_cached_reqs.num_reqs == 1", len(output.scheduled_cached_reqs.req_ids), 1)
    expect("len(scheduler.running) == 2", len(h.scheduler.running), 2)
    h.update(output, {low.request_id: [100], high.request_id: [100]})
    output = h.schedule()  # 3rd schedule: low needs 32 tokens, high 33 -- 5 blocks, and 4 fit
    expect("len(output.scheduled_new_reqs) == 0", len(output.scheduled_new_reqs), 0)
    expect("output.scheduled_cached_reqs.req_ids[0] == request_high.request_id",
           output.scheduled_cached_reqs.req_ids[:1], [high.request_id])
    expect("scheduler.requests[request_low.request_id].status == RequestStatus.PREEMPTED", low.status,
           RequestStatus.PREEMPTED)
    expect("output.scheduled_cached_reqs.num_reqs == 1", len(output.scheduled_cached_reqs.req_ids), 1)
    expect("len(scheduler.waiting) == 1", len(h.scheduler.waiting), 1)
    expect("len(scheduler.running) == 1", len(h.scheduler.running), 1)
    h.update(output, {low.request_id: [], high.request_id: [100]})
    h.finish_requests(high)  # to make room for the preempted request to resume
    output = h.schedule()  # 4th schedule: the resumption
    expect("len(scheduler.waiting) == 0", len(h.scheduler.waiting), 0)
    expect("len(scheduler.running) == 1", len(h.scheduler.running), 1)
    expect("len(output.scheduled_new_reqs) == 0", len(output.scheduled_new_reqs), 0)
    expect("scheduled_cached_reqs.req_ids[0] == request_low.request_id", output.scheduled_cached_reqs.req_ids[:1],
           [low.request_id])
    expect("request_low.request_id in scheduled_cached_reqs.resumed_req_ids",
           low.request_id in output.scheduled_cached_reqs.resumed_req_ids)
    expect("len(scheduled_cached_reqs.all_token_ids[request_low.request_id]) == 32",
           len(output.scheduled_cached_reqs.all_token_ids.get(low.request_id, ())), 32,
           "resumed tokens include 30 prompt tokens and 2 decoded tokens")


# vLLM's tests in its order, name -> (the test, its arguments besides cls). Many differ only in their requests: the
# priorities and arrival times of the requests made, the ids scheduled first and (one slot) those left waiting.
TESTS = {f"test_priority_scheduling_{name}": case for name, case in {
    "basic_ordering": (_order_case, dict(priorities=[2, 0, 1], arrival_times=[1.0, 2.0, 3.0], want=["1", "2", "0"])),
    "arrival_time_tiebreaker": (_order_case, dict(priorities=[1, 1, 1], arrival_times=[3.0, 1.0, 2.0],
                                                  want=["1", "2", "0"])),
    "mixed_priority_and_arrival": (_order_case, dict(priorities=[2, 1, 1, 0], arrival_times=[1.0, 3.0, 2.0, 4.0],
                                                     want=["3", "2", "1", "0"])),
    "preemption": (test_priority_scheduling_preemption, {}),
    "no_preemption_when_space_available": (test_priority_scheduling_no_preemption_when_space_available, {}),
    "preemption_victim_selection": (_one_slot_case, dict(priorities=[3, 2, 0], arrival_times=[1.0, 2.0, 3.0],
                                                         first=["2"], waiting_ids=["1", "0"])),
    "equal_priority_preemption": (_one_slot_case, dict(priorities=[2, 2, 2], arrival_times=[3.0, 1.0, 2.0],
                                                       first=["1"], waiting_ids=["2", "0"])),
    "waiting_queue_order": (_one_slot_case, dict(priorities=[3, 1, 2, 0], arrival_times=[1.0, 2.0, 3.0, 4.0],
                                                 first=["3"], waiting_ids=["1", "2", "0"])),
    "fcfs_fallback": (_order_case, dict(priorities=[1, 1, 1, 1], arrival_times=[4.0, 1.0, 3.0, 2.0],
                                        want=["1", "3", "2", "0"])),
    "with_limited_slots": (_one_slot_case, dict(priorities=[3, 1, 2, 0], arrival_times=[1.0, 2.0, 3.0, 4.0],
                                                first=["3", "1"], waiting_ids=["2", "0"], max_num_seqs=2,
                                                max_num_batched_tokens=1000)),
    "heap_property": (test_priority_scheduling_heap_property, {}),
    "preemption_and_resumption_when_out_of_kv": (test_priority_scheduling_preemption_and_resumption_when_out_of_kv, {}),
}.items()}
