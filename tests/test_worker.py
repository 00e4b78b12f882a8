"""The worker below the engine (vLLM V1's ``v1/worker``): its persistent batch is rows of tensors changed only
by the message, it holds nothing once the engine is idle, it carries out V0's swaps, it finds results by
request id, and with async scheduling a prompt's forked samples stay exact even when the prompt is
preempted while its last step is in flight. Every run is compared with per-prompt ``generate``."""
from __future__ import annotations

import random

import pytest
import torch

from cbteach import Engine, Request, SamplingParams
from cbteach.core.scheduler_output import RunnerOutput
from cbteach.core.request import RequestStatus
from cbteach.engine.scheduler_v0 import V0SchedulerOutput
from cbteach.engine.scheduler import Scheduler
from cbteach.engine.scheduler_v0 import V0Scheduler
from conftest import ARCHS, VOCAB, reference, tiny_model


def _requests(seed, n=6, max_new=8, **sp):
    g = random.Random(seed)
    return [Request([g.randrange(6, VOCAB) for _ in range(g.randint(2, 13))], g.randint(2, max_new), request_id=i,
                    ignore_eos=True, sampling_params=SamplingParams(**sp)) for i in range(n)]


def _exact(model, reqs, outs):
    for r, c in zip(reqs, outs):
        want = reference(model, r.prompt, r.max_new_tokens)
        for s in c.samples or [c]:
            assert s.output_ids == want, (r.request_id, s.output_ids, want)


def _drive(eng):
    while eng.has_requests():
        if eng.step().idle:
            eng.wait_for_arrival()


@pytest.mark.parametrize("options", [
    dict(), dict(async_scheduling=True), dict(parallel_sampling="fork", prefix_caching=True),
    dict(parallel_sampling="fanout", prefix_caching=True), dict(speculative="ngram", token_budget=7),
    dict(preemption="swap", num_blocks=9), dict(num_blocks=9, token_budget=5, async_scheduling=True)])
def test_after_run_returns_the_worker_holds_no_request(options):
    """V1's ``has_requests``: finished ids reach the worker in one more message after the last step."""
    model = tiny_model("llama")
    eng = Engine(model, max_batch_size=3, kv="paged", block_size=4, **options)
    n = 2 if "parallel_sampling" in options else 1
    reqs = _requests(3, max_new=9, n=n)
    outs = eng.run(reqs)
    _exact(model, reqs, outs)
    runner = eng.executor.runner
    assert runner.requests == {} and runner.input_batch.num_reqs == 0 and runner.input_batch.req_ids == []
    assert not getattr(eng.kv, "swap_space", None) and eng.kv_usage()["num_used_blocks"] == 0  # (host copies: V0 only)
    assert not eng.has_requests()


@pytest.mark.parametrize("options", [dict(), dict(num_blocks=8, token_budget=6), dict(prefix_caching=True),
                                     dict(preemption="swap", num_blocks=8)])
def test_the_batch_rows_are_the_scheduled_requests_after_every_step(options):
    """Rows ``0 .. num_reqs - 1`` hold exactly this step's requests: their known tokens (prompt + output),
    where they start next, their block tables -- read from the row tensors, not from any list."""
    model = tiny_model("qwen2")
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, **options)
    for r in _requests(5, n=7, max_new=14):
        eng.add_request(r)
    checked = 0
    while eng.has_requests():
        record = eng.step()
        b = eng.executor.runner.input_batch
        assert sorted(b.req_ids, key=str) == sorted((s.request_id for s in record.seqs), key=str)
        for row, rid in enumerate(b.req_ids):
            seq = eng.sequences[rid]
            if seq.status is not RequestStatus.RUNNING:
                continue
            assert b.req_id_to_index[rid] == row
            assert b.token_row(row) == seq.prompt_ids + seq.output_ids
            assert b.block_table.row(row) == seq.block_table
            checked += 1
    assert checked > 20


def test_swaps_are_carried_out_by_the_worker_from_the_message():
    """V0's swap: the scheduler only names the blocks (``V0SchedulerOutput``); the pool is copied while the
    worker runs the message, never while the scheduler plans."""
    model = tiny_model("gpt2")
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, num_blocks=8, preemption="swap")
    assert isinstance(eng.scheduler, V0Scheduler)
    inside, copies, messages = [False], [], []
    execute = eng.executor.execute_model

    def traced(msg):
        messages.append(msg)
        inside[0] = True
        try:
            return execute(msg)
        finally:
            inside[0] = False

    kv = eng.kv
    swap_out, swap_in = kv.swap_out_blocks, kv.swap_in_blocks
    kv.swap_out_blocks = lambda rid, blocks: (copies.append(("out", inside[0])), swap_out(rid, blocks))[1]
    kv.swap_in_blocks = lambda rid, blocks: (copies.append(("in", inside[0])), swap_in(rid, blocks))[1]
    eng.executor.execute_model = traced
    reqs = _requests(7, n=6, max_new=12)
    _exact(model, reqs, eng.run(reqs))
    assert all(isinstance(m, V0SchedulerOutput) for m in messages)
    outs = sum(len(m.blocks_to_swap_out) for m in messages)
    ins = sum(len(m.blocks_to_swap_in) for m in messages)
    assert outs >= 2 and ins >= 2, "the workload was meant to swap"
    assert copies.count(("out", True)) == outs and copies.count(("in", True)) == ins
    assert ("out", False) not in copies and ("in", False) not in copies, "the pool was copied outside the worker's step"


def test_no_message_schedules_a_request_for_zero_tokens_and_resumed_ones_are_flagged():
    """A request planned for nothing is not in the message (V1's running loop skips it); one back after a
    preemption is flagged as resumed, with its whole table, and its tokens when it missed the step before."""
    sent = []

    class Keeping(Scheduler):
        def schedule(self, now):
            out = super().schedule(now)
            sent.append((out, {r: (list(s.prompt_ids) + list(s.output_ids)) for r, s in self.requests.items()}))
            return out

    model = tiny_model("llama")
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, num_blocks=7, token_budget=6,
                 async_scheduling=True, scheduler_cls=Keeping)
    reqs = _requests(11, n=6, max_new=10)
    _exact(model, reqs, eng.run(reqs))
    assert all(n >= 1 for m, _ in sent for n in m.num_scheduled_tokens.values())
    preempted = {rid for m, _ in sent for rid in m.preempted_req_ids}
    resumed = [(m, tokens) for m, tokens in sent if m.scheduled_cached_reqs.resumed_req_ids]
    assert preempted and resumed, "the workload was meant to preempt"
    for m, tokens in resumed:
        c = m.scheduled_cached_reqs
        assert c.resumed_req_ids <= preempted
        for rid in c.resumed_req_ids:
            i = c.req_ids.index(rid)
            assert c.num_computed_tokens[i] == 0 and c.new_block_ids[i], "a resumed request gets its whole new table"
        for rid, all_ids in c.all_token_ids.items():
            assert rid in c.resumed_req_ids and list(all_ids) == tokens[rid][:len(all_ids)]


def test_results_are_found_by_request_id_whatever_their_order():
    """The worker's output is in its batch's row order; the update finds each request's result through
    ``req_id_to_index`` (V1). Reversing every output changes nothing."""
    model = tiny_model("gpt2")
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, num_blocks=10, token_budget=7)
    execute = eng.executor.execute_model
    reversed_steps = [0]

    def reverse(msg):
        out = execute(msg)
        if len(out.req_ids) < 2:
            return out
        reversed_steps[0] += 1
        flip = lambda xs: None if xs is None else xs[::-1]  # noqa: E731
        return RunnerOutput(sampled=out.sampled[::-1], req_ids=out.req_ids[::-1],
                            forward_time=out.forward_time, traffic=out.traffic,
                            errors=flip(out.errors))

    eng.executor.execute_model = reverse
    reqs = _requests(13, n=6, max_new=9)
    _exact(model, reqs, eng.run(reqs))
    assert reversed_steps[0] > 5


class Spy(Scheduler):
    """Counts forks whose parent was no longer running when its prompt's last step came back."""

    orphans = 0

    def _fork(self, parent, sample, token, computed, now, finished):
        if parent.status is not RequestStatus.RUNNING:
            Spy.orphans += 1
        return super()._fork(parent, sample, token, computed, now, finished)


@pytest.mark.parametrize("arch", ARCHS)
def test_async_fork_stays_exact_when_the_parent_is_preempted_while_its_prompts_last_step_is_in_flight(arch):
    """Plan N+1 preempts the parent P (recompute: its blocks go back) while P's prompt-ending step N runs;
    N's sampled first tokens still reach P's samples, which -- with no blocks to share -- compute the
    prompt again. Before, they decoded over K/V nobody wrote for them."""
    model = tiny_model(arch)
    Spy.orphans = 0
    for num_blocks, delay, plen, alen in [(4, 4, 8, 2), (5, 2, 8, 5), (5, 4, 9, 3), (4, 5, 5, 2)]:
        eng = Engine(model, None, kv="paged", block_size=4, num_blocks=num_blocks, max_batch_size=4,
                     async_scheduling=True, parallel_sampling="fork", scheduler_cls=Spy)
        a = Request(list(range(10, 10 + alen)), 14, request_id="a", ignore_eos=True)
        p = Request(list(range(30, 30 + plen)), 6, request_id="p", ignore_eos=True, sampling_params=SamplingParams(n=2))
        eng.add_request(a)
        for _ in range(delay):
            eng.step()
        eng.add_request(p)
        _drive(eng)
        _exact(model, [a, p], [eng.completions["a"], eng.completions["p"]])
        assert eng.kv_usage()["num_used_blocks"] == 0 and eng.executor.runner.requests == {}
    assert Spy.orphans >= 2, "the parent was meant to be preempted while its prompt's last step was in flight"


def test_each_sample_is_forked_once_under_async_scheduling():
    """The plan after a prompt's last step still holds the prompt's samples (the update has not run):
    the message sends them only with the step that ends the prompt, so the worker forks each once."""
    forked = []

    class Keeping(Scheduler):
        def schedule(self, now):
            out = super().schedule(now)
            forked.extend(sid for forks in out.scheduled_forks.values() for sid, _ in forks)
            return out

    model = tiny_model("llama")
    eng = Engine(model, max_batch_size=6, kv="paged", block_size=4, async_scheduling=True, parallel_sampling="fork",
                 scheduler_cls=Keeping)
    reqs = [Request([7, 8, 9, 10, 11], 6, request_id=i, ignore_eos=True,
                    sampling_params=SamplingParams(n=3, temperature=0.8, seed=i)) for i in range(2)]
    outs = eng.run(reqs)
    assert sorted(forked) == sorted([(i, k) for i in range(2) for k in (1, 2)])
    alone = [Engine(model, max_batch_size=6, kv="paged", block_size=4, parallel_sampling="fork").run([r])[0]
             for r in reqs]
    assert [[s.output_ids for s in c.samples] for c in outs] == [[s.output_ids for s in c.samples] for c in alone]


def test_async_steps_read_the_last_steps_tokens_on_the_device():
    """V1's ``prev_sampled_token_ids``: when step N+1 is prepared, the host has not got N's tokens yet (its
    decodes' inputs are pending) -- they are read from the device tensor N sampled into, and copied to the
    host only after N+1 is launched (cbteach.worker.async_runner). Still exact."""
    model = tiny_model("llama")
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, async_scheduling=True)
    pipeline = eng.executor.pipeline
    feed, pending = pipeline.feed, []

    def watched(step, step_pending):  # (step_pending: packed positions, and the rows of the tokens fed there)
        pending.append((len(step.counts), 0 if step_pending is None else len(step_pending[0])))
        feed(step, step_pending)

    pipeline.feed = watched
    reqs = _requests(17, n=5, max_new=12)
    _exact(model, reqs, eng.run(reqs))
    fed_steps = [n for n, fed in pending if fed]
    assert len(fed_steps) >= len(pending) // 2, pending
    assert sum(fed for _, fed in pending) > 20


def test_a_step_copied_beside_is_read_from_its_host_copy_after_its_event():
    """On CUDA the async runner starts a step's device -> host copy on a side stream as soon as it has
    sampled (``copy_beside``, V1's ``AsyncGPUModelRunnerOutput``), so finishing it waits for that copy, not
    for the next step queued behind it. Without a GPU here: what is read is the host copy, once its event
    is waited on, with the finite flags; and a CPU runner makes no side stream."""
    from cbteach.worker.async_runner import CopiedSample

    waited = []

    class Event:
        def synchronize(self):
            waited.append(True)

    sample = CopiedSample(tokens=torch.tensor([0, 0]), top=torch.tensor([0.0, 0.0]), ready=Event(),
                          host=(torch.tensor([5, 7]), torch.tensor([1.5, float("nan")])))
    assert sample.to_host() == ([5, 7], [True, False]) and waited == [True]
    eng = Engine(tiny_model("llama"), max_batch_size=2, kv="paged", async_scheduling=True)
    assert eng.executor.pipeline.copy_stream is None
