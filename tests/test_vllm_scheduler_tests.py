"""vLLM's own scheduler tests, ported (:mod:`cbteach.exercises.vllm_scheduler_tests`): the engine's
scheduler and notebook 06's solutions pass every one; a typical wrong scheduler fails the test meant
for its mistake, with vLLM's assertion quoted; a stub or a delegating class is told so."""
import json
import math
from pathlib import Path

import pytest

from cbteach.core.request import RequestStatus
from cbteach.core.sampling import stop_reason
from cbteach.core.scheduler_output import StepPlan
from cbteach.engine.scheduler import Scheduler
from cbteach.exercises import vllm_scheduler_tests as V
from cbteach.exercises.vllm_harness import VLLM_COMMIT

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "06_scheduling_and_latency.ipynb"
SCHEDULE, UPDATE, *_ = ("".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"]
                         if "solution" in c.get("metadata", {}).get("tags", []))  # (the third: the worker's update)


def defined(src, name):
    namespace = {"math": math, "Scheduler": Scheduler, "StepPlan": StepPlan, "RequestStatus": RequestStatus,
                 "stop_reason": stop_reason}
    exec(compile(src, name, "exec"), namespace)
    return namespace[name]


def mine(schedule=SCHEDULE, update=UPDATE):
    return defined(schedule, "MyScheduler"), defined(update, "MyUpdate")


def test_the_engines_own_scheduler_passes_every_ported_test():
    result = V.run(Scheduler)
    assert not result.failed and not result.delegated, str(result)
    assert len(result.passed) == len(V.TESTS) == 25
    assert f"passes 25 of vLLM's 25 ported scheduler tests (vllm-project/vllm@{VLLM_COMMIT[:7]}" in str(result)


def test_notebook_06s_solutions_pass_every_ported_test(capsys):
    assert V.check_vllm_tests(*mine())
    out = capsys.readouterr().out
    assert "passes 25 of vLLM's 25" in out and "a second opinion, not a proof" in out, out


def test_an_update_that_returns_a_tuple_passes_as_the_engine_takes_it(capsys):
    """The engine core only iterates over what update_from_output returns, and notebook 06's stage 5 takes a
    tuple; the ported tests refused it in 14 of 25 ("returned tuple, not the list")."""
    assert V.check_vllm_tests(*mine(update=swap(UPDATE, "        return finished", "        return tuple(finished)")))
    assert "passes 25 of vLLM's 25" in capsys.readouterr().out


def swap(src, old, new):
    assert old in src, f"notebook 06's solution no longer contains {old!r}: update this wrong scheduler"
    return src.replace(old, new)


ARRIVED = "[s for s in self.waiting if s.arrival_time <= now]"
# name -> (schedule source, update source, a test it must fail, words of vLLM's assertion quoted)
WRONG = {
    "guesses not planned": (swap(SCHEDULE, "seq.num_tokens + len(seq.draft_ids) - seq.num_computed_tokens",
                                 "seq.num_tokens - seq.num_computed_tokens"), UPDATE,
                            "test_schedule_spec_decoding_stats[perfect match]",
                            "`output.total_num_scheduled_tokens == len(requests) + sum(len(ids) for ids in spec_tokens)` "
                            "-- here 1, not 4"),
    "prompts admitted whole, never chunked": (swap(SCHEDULE, "n = min(seq.num_tokens - num_cached_tokens, budget)",
                                                   "n = seq.num_tokens - num_cached_tokens\n            if n > budget:"
                                                   "\n                break"), UPDATE,
                                              "test_schedule_order[chunked prefill]",
                                              "`len(scheduler_output1.scheduled_new_reqs) == 2` -- here 1, not 2"),
    "the newest running request as victim, whatever the policy": (
        swap(SCHEDULE, "victim = self.waiting.pick_victim(self.running)", "victim = self.running[-1]"), UPDATE,
        "test_priority_scheduling_preemption", "`lo1_req.status == RequestStatus.PREEMPTED`"),
    "admissions by arrival, whatever the policy": (
        swap(SCHEDULE, "for seq in " + ARRIVED, "for seq in sorted(" + ARRIVED + ", key=lambda s: s.arrival_time)"),
        UPDATE, "test_priority_scheduling_basic_ordering", "`scheduled_req_ids == ['1', '2', '0']`"),
    "tokens appended past a stop": (SCHEDULE, swap(UPDATE, "drops the guesses after it\n                    break",
                                                   "drops the guesses after it\n                    pass"),
                                    "test_stop_via_update_from_output", "`len(scheduler.running) == 1` -- here 2, not 1"),
    "a finished request's blocks never freed": (SCHEDULE, swap(UPDATE, "self.kv_manager.free(seq)", "pass"),
                                                "test_memory_leak", "every block back"),
    "rejected guesses not taken back": (SCHEDULE, swap(UPDATE, "seq.num_computed_tokens -= drafts - (len(tokens) - 1)",
                                                       "pass"), "test_schedule_spec_decoding_stats[early mismatch]",
                                        "`stats.num_accepted_tokens == expected[2]` -- here 3, not 1"),
}


@pytest.mark.parametrize("name", WRONG)
def test_a_wrong_scheduler_fails_with_vllms_assertion_quoted(name):
    schedule, update, test, words = WRONG[name]
    result = V.run(*mine(schedule, update))
    assert test in result.failed, f"{name}: {test} passed ({result})"
    assert f"vLLM asserts {words}" in result.failed[test] or words in result.failed[test], result.failed[test]
    assert f"✗ {test}: vLLM asserts" in str(result)
    assert 0 < len(result.passed) < len(V.TESTS)  # the rest of it still counts


def test_the_student_copys_stubs_are_told_they_are_not_done_and_nothing_raises(capsys):
    class Stub(Scheduler):  # what the student copy hands out
        def schedule(self, now):
            ...

    class StubUpdate(Scheduler):
        def update_from_output(self, scheduler_output, output, now):
            ...

    assert not V.check_vllm_tests(Stub, StubUpdate)
    out = capsys.readouterr().out
    assert "passes 0 of vLLM's 25" in out and "not done yet" in out
    for nothing in ((None,), (..., ...), (Stub, 3)):
        assert not V.check_vllm_tests(*nothing)
        assert "not done yet" in capsys.readouterr().out


def test_a_scheduler_that_runs_the_engines_own_is_named(capsys):
    class Lazy(Scheduler):
        def schedule(self, now):
            return super().schedule(now)

    assert not V.check_vllm_tests(Lazy)
    out = capsys.readouterr().out
    assert "calls the engine's Scheduler.schedule (through super().schedule)" in out, out
    assert "these results are the engine's" in out, out


def test_the_module_says_which_of_vllms_tests_are_left_out_and_why():
    doc = V.__doc__
    for left_out in ("test_preempt_during_execution", "test_schedule_concurrent_partial_requests",
                     "test_check_stop_min_tokens", "test_spec_decoding_stats_empty_output", "test_add_requests"):
        assert left_out in doc
    for name in V.TESTS:
        assert name.split("[")[0] in doc or name.startswith("test_priority"), name
    assert "003df29" in doc
