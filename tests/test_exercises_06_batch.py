"""Notebook 06b, section 3: the learner's ``update_batch`` (vLLM V1's ``_update_states``). The notebook's
solution passes on every architecture and on bierce; the check's workloads take every branch of the
update; each typical mistake -- made once, in a copy of the solution -- fails with the hint meant for
it; anything a learner passes gets a hint; a function that is, copies or calls the worker's own is
refused; the student copy's stub is "not done yet"."""
import contextlib
import functools
import io
import json
import re
from pathlib import Path

import pytest

from cbteach.exercises import ex06_batch
from cbteach.exercises.batch_rules import HINTS
from cbteach.student import stub
from cbteach.worker import model_runner
from cbteach.worker.input_batch import CachedRequestState
from cbteach.worker.model_runner import new_generator
from conftest import ARCHS, tiny_model

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "06b_the_worker.ipynb"
SOLUTION = next("".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"]
                if "solution" in c.get("metadata", {}).get("tags", []) and "def update_batch" in "".join(c["source"]))


def defined(src):
    """``update_batch`` as ``src`` defines it, with what notebook 06b imported before it."""
    namespace = {"CachedRequestState": CachedRequestState, "new_generator": new_generator}
    exec(compile(src, "update_batch", "exec"), namespace)
    return namespace.get("update_batch")


def with_mistake(old, new):
    assert old in SOLUTION, f"the notebook's solution no longer contains {old!r}: update this mistake"
    return defined(SOLUTION.replace(old, new))


def check(fn, model):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ok = ex06_batch.check_update_batch(fn, model)
    return ok, out.getvalue()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.mark.parametrize("arch", ARCHS)
def test_the_notebooks_solution_passes(arch):
    ok, out = check(defined(SOLUTION), tiny_model(arch))
    assert ok and out.startswith("✓"), out


def test_the_notebooks_solution_passes_on_bierce(bierce):
    ok, out = check(defined(SOLUTION), bierce[0])
    assert ok, out


@pytest.mark.parametrize("which", ["llama", "bierce"])
def test_the_workloads_take_every_branch_of_the_update(which, model, bierce):
    """Finished requests (one aborted while it waited), prompts in chunks, rows of running requests left out of a
    step, preemption and resumption (with token ids), prefix-cache hits, forked samples and tables replaced by
    copies on write --
    on a tiny random model and on bierce, whose answers stop at EOS."""
    model = bierce[0] if which == "bierce" else model
    seen = []
    for w in ex06_batch.WORKLOADS:
        _, messages, said = ex06_batch.run_workload(model, w, defined(SOLUTION))
        assert said is None, said
        seen += [(w, m) for m in messages]
    count = {"finished": sum(len(m.finished_req_ids) for _, m in seen),
             "chunks": sum(n < len(r.prompt_token_ids) for _, m in seen for r in m.scheduled_new_reqs
                           for n in [m.num_scheduled_tokens[r.req_id]]),
             "resumed": sum(len(m.scheduled_cached_reqs.resumed_req_ids) for _, m in seen),
             "all_token_ids": sum(len(m.scheduled_cached_reqs.all_token_ids) for _, m in seen),
             "replaced": sum(len(m.scheduled_cached_reqs.replaced_req_ids) for _, m in seen),
             "prefix hits": sum(r.num_computed_tokens > 0 for _, m in seen for r in m.scheduled_new_reqs),
             "forks": sum(len(f) for _, m in seen for f in getattr(m, "scheduled_forks", {}).values()),  # fork's message
             "finished while waiting": sum(r not in {q for _, p in seen[:i] for q in p.num_scheduled_tokens}
                                           for i, (_, m) in enumerate(seen) for r in m.finished_req_ids),
             "left out": sum(r not in b.num_scheduled_tokens and r not in b.finished_req_ids
                             and r not in b.preempted_req_ids
                             for (wa, a), (wb, b) in zip(seen, seen[1:]) if wa is wb for r in a.num_scheduled_tokens)}
    assert all(n > 0 for n in count.values()), count


MISTAKES = {  # the mistake, made once in the solution -> the hint that must name it
    "a finished request's state kept": ("        runner.requests.pop(req_id, None)\n", "", "finished_state"),
    "a finished request deleted, as if the worker held every one": (
        "        runner.requests.pop(req_id, None)\n", "        del runner.requests[req_id]\n", "never_held"),
    "rows of requests not scheduled kept": ("        batch.remove_request(req_id)  # 2.", "        pass  # 2.",
                                            "unscheduled_row"),
    "a preempted request's state dropped": ("        batch.remove_request(req_id)  # 2.",
                                            "        runner.requests.pop(req_id, None); batch.remove_request(req_id)  # 2.",
                                            "state_dropped"),
    "a resumed request's blocks appended": ("req_id in cached.resumed_req_ids | cached.replaced_req_ids",
                                            "req_id in cached.replaced_req_ids", "appended"),
    "a copied-on-write table appended": ("req_id in cached.resumed_req_ids | cached.replaced_req_ids",
                                         "req_id in cached.resumed_req_ids", "appended"),
    "num_computed_tokens not updated in the row": (
        "        batch.num_computed_tokens[row] = state.num_computed_tokens  # in place: it keeps its row\n", "",
        "computed"),
    "num_computed_tokens not updated": ("state.num_computed_tokens, new_block_ids = cached.num_computed_tokens[i], "
                                        "cached.new_block_ids[i]", "new_block_ids = cached.new_block_ids[i]",
                                        "computed_cached"),
    "a new request started at 0 (prefix hits)": ("list(new.block_ids), new.num_computed_tokens,", "list(new.block_ids), 0,",
                                                  "prefix"),
    "condense forgotten": ("    batch.condense()\n", "", "holes"),
    "new blocks not appended": ("            batch.block_table.append_row(new_block_ids, row)", "            pass",
                                "not_appended"),
    "all_token_ids taken whole as the output": ("cached.all_token_ids[req_id][len(state.prompt_token_ids):]",
                                                "cached.all_token_ids[req_id]", "all_tokens"),
    "a forked sample given a fresh generator": ("held.generator if held else new_generator(new)", "new_generator(new)",
                                                "forked"),
    "a forked sample's held state kept as it was": (  # (was told about prefix-cache hits)
        "        held = runner.requests.get(new.req_id)",
        "        held = runner.requests.get(new.req_id)\n        if held is not None:\n            to_add.append(held)\n"
        "            continue", "forked_stale"),
    "a seeded request given no generator": ("held.generator if held else new_generator(new)",
                                            "held.generator if held else None", "seeded"),
    "a request without a row never added back": ("            to_add.append(state)  # (added below)\n", "",
                                                  "missing_row"),
    "nothing added to the batch": ("        batch.add_request(state)\n", "        pass\n", "missing_row"),
    "a request that kept its row added again": ("        if (row := batch.req_id_to_index.get(req_id)) is None:",
                                                "        if (row := batch.req_id_to_index.get(req_id)) or True:", "twice"),
    "a running request's table replaced by its new blocks": (
        "req_id in cached.resumed_req_ids | cached.replaced_req_ids\n", "True\n", "replaced"),
    "the row set to where the step ends": (  # (was told the row still starts where it started before)
        "        batch.num_computed_tokens[row] = state.num_computed_tokens  # in place: it keeps its row\n",
        "        batch.num_computed_tokens[row] = state.num_computed_tokens + msg.num_scheduled_tokens[req_id]\n",
        "computed_end"),
    "the row taken as the place in the message": ("        batch.num_computed_tokens[row] = state.num_computed_tokens",
                                                  "        batch.num_computed_tokens[i] = state.num_computed_tokens",
                                                  "wrong_row"),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_each_typical_mistake_fails_with_the_hint_meant_for_it(mistake, model):
    old, new, key = MISTAKES[mistake]
    ok, out = check(with_mistake(old, new), model)
    want = max(re.split(r"\{\w+\}", HINTS[key]), key=len)  # the hint's words (less what it fills in)
    assert not ok and want in out, (mistake, out)


def test_a_function_that_raises_gets_the_error_and_its_line(model):
    ok, out = check(with_mistake("    batch.condense()\n", "    batch.condense()\n    raise KeyError('oops')\n"), model)
    assert not ok and "your update_batch stopped with KeyError" in out and "line" in out, out


def test_ignoring_all_token_ids_changes_nothing_here_because_the_worker_holds_those_tokens(model):
    """The notebook says so: at every message that sends a resumed request's token ids, the worker's
    state for it already holds exactly those tokens (it appends what it samples to every state)."""
    compared = []

    def watching(runner, scheduler_output):
        for rid, ids in scheduler_output.scheduled_cached_reqs.all_token_ids.items():
            s = runner.requests[rid]
            compared.append(list(ids) == s.prompt_token_ids + s.output_token_ids)
        return defined(SOLUTION)(runner, scheduler_output)

    for w in ex06_batch.WORKLOADS:
        assert ex06_batch.run_workload(model, w, watching)[2] is None
    assert compared and all(compared), compared
    ok, out = check(with_mistake("        if req_id in cached.all_token_ids:", "        if False:"), model)
    assert ok, out


def test_removing_rows_while_walking_the_batch_says_to_walk_a_copy(model):
    wrong = with_mistake(
        "    for req_id in set(batch.req_id_to_index) - (set(msg.num_scheduled_tokens) - cached.resumed_req_ids):\n",
        "    for req_id in batch.req_id_to_index:\n"
        "        if req_id in msg.num_scheduled_tokens and req_id not in cached.resumed_req_ids:\n"
        "            continue\n")
    ok, out = check(wrong, model)
    assert not ok and "changed size during iteration" in out and "walk a copy, a list made before the loop" in out, out


@pytest.mark.parametrize("answer,words", [
    (None, "not done yet"), (..., "not done yet"), (42, "pass your function itself"),
    (lambda runner: None, "update_batch is called as update_batch(runner, scheduler_output), and '<lambda>' "
                          "cannot take those two arguments"), (lambda runner, scheduler_output: None, "not done yet"),
])
def test_anything_a_learner_passes_gets_a_hint(answer, words, model):
    ok, out = check(answer, model)
    assert not ok and words in out, out


def test_the_student_copys_stub_is_not_done_yet(model):
    namespace = {}
    exec(compile(stub(SOLUTION), "stub", "exec"), namespace)
    ok, out = check(namespace["update_batch"], model)
    assert not ok and "not done yet" in out, out


def _wrapper(runner, scheduler_output):
    model_runner.update_batch(runner, scheduler_output)


CHEATS = {
    "the worker's own": lambda: model_runner.update_batch,
    "a wrapper that calls it": lambda: _wrapper,
    "a partial of it": lambda: functools.partial(model_runner.update_batch),
}


@pytest.mark.parametrize("cheat", CHEATS)
def test_a_function_that_is_copies_or_calls_the_workers_own_is_refused(cheat, model):
    ok, out = check(CHEATS[cheat](), model)
    assert not ok and "write the batch update yourself" in out and "cbteach.worker.model_runner" in out, out
