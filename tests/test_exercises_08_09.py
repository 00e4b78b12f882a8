"""Notebooks 08-09: the self-checks accept right answers and name the rule a wrong one missed; the new pictures."""
import math
import random

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest
import torch

from cbteach import Engine, Request
from cbteach.exercises import ex08, ex09
from cbteach.serving.metrics import summarize
from cbteach.viz import sharing
from conftest import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def run(check, *args, capsys):
    ok = check(*args)
    return ok, capsys.readouterr().out


# -- notebook 08, exercise 1: what the prefix cache reuses ------------------------------------------

def lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def right_reuse(prompts, bs):
    return [max([lcp(p[:-1], q) // bs * bs for q in prompts[:j]], default=0) for j, p in enumerate(prompts)]


def all_shared_tokens(prompts, bs):  # no rounding to blocks
    return [max([lcp(p[:-1], q) for q in prompts[:j]], default=0) for j, p in enumerate(prompts)]


def no_last_token_rule(prompts, bs):
    return [max([lcp(p, q) // bs * bs for q in prompts[:j]], default=0) for j, p in enumerate(prompts)]


def in_blocks(prompts, bs):  # the number of blocks, not of tokens
    return [n // bs for n in right_reuse(prompts, bs)]


def two_short(prompts, bs):  # the prompt's last two tokens left out of the lookup
    return [max([lcp(p[:-2], q) // bs * bs for q in prompts[:j]], default=0) for j, p in enumerate(prompts)]


def previous_only(prompts, bs):
    return [lcp(p[:-1], prompts[j - 1]) // bs * bs if j else 0 for j, p in enumerate(prompts)]


def unchained(prompts, bs):  # equal blocks at the same index count even after a mismatch
    out = []
    for j, p in enumerate(prompts):
        u = p[:-1]
        out.append(max([sum(bs for i in range(0, min(len(u), len(q)) - bs + 1, bs) if u[i:i + bs] == q[i:i + bs])
                        for q in prompts[:j]], default=0))
    return out


def blocks_anywhere(prompts, bs):
    """Blocks from the start whose tokens any earlier prompt holds as a block, at whatever place (no chain)."""
    seen, out = set(), []
    for p in prompts:
        n = 0
        for i in range(0, len(p) - bs, bs):
            if tuple(p[i:i + bs]) not in seen:
                break
            n += bs
        out.append(n)
        seen.update(tuple(p[i:i + bs]) for i in range(0, len(p) - bs + 1, bs))
    return out


def cuts_the_prompts(prompts, bs):
    """Leaves out each prompt's last token by popping it: the earlier prompts are cut short too."""
    out = []
    for j, p in enumerate(prompts):
        p.pop()
        out.append(max([lcp(p, q) // bs * bs for q in prompts[:j]], default=0))
    return out


def rounded_up(prompts, bs):
    return [max([math.ceil(lcp(p[:-1], q) / bs) * bs for q in prompts[:j]], default=0) for j, p in enumerate(prompts)]


def earlier_less_last(prompts, bs):  # the last-token rule applied to the earlier prompts too
    return [max([lcp(p[:-1], q[:-1]) // bs * bs for q in prompts[:j]], default=0) for j, p in enumerate(prompts)]


def longest_only(prompts, bs):  # only the longest earlier prompt looked at
    return [lcp(p[:-1], max(prompts[:j], key=len)) // bs * bs if j else 0 for j, p in enumerate(prompts)]


def summed(prompts, bs):  # the matches with every earlier prompt added up, not the best one
    return [sum(lcp(p[:-1], q) // bs * bs for q in prompts[:j]) for j, p in enumerate(prompts)]


def first_not_zero(prompts, bs):
    return [bs] + right_reuse(prompts, bs)[1:]


def test_prefix_reuse_accepts_the_rule(model, capsys):
    ok, out = run(ex08.check_prefix_reuse, right_reuse, model, capsys=capsys)
    assert ok and out.startswith("✓") and f"all {len(ex08.PREFIX_CASES)} cases" in out


def test_prefix_reuse_takes_a_tensor_or_an_array_of_counts(model, capsys):
    """``torch.tensor([...])`` was "should return a list of 5 ints" (its items are 0-d tensors)."""
    import numpy as np

    for form in (torch.tensor, np.array):
        ok, out = run(ex08.check_prefix_reuse, lambda p, bs: form(right_reuse(p, bs)), model, capsys=capsys)
        assert ok, out


def test_prefix_reuse_checks_the_notebooks_prompts_first(model, capsys):
    system = [10 + i % 70 for i in range(40)]
    prompts = [system + [3, 4], system + [5], system + [3, 4], [3, 4]]
    ok, out = run(ex08.check_prefix_reuse, right_reuse, model, prompts, 16, capsys=capsys)
    assert ok and f"all {len(ex08.PREFIX_CASES) + 1} cases" in out
    ok, out = run(ex08.check_prefix_reuse, all_shared_tokens, model, prompts, 16, capsys=capsys)
    assert not ok and "the notebook's prompts" in out
    assert "32" not in out  # the engine's answer (2 full blocks of 16) is not given away


@pytest.mark.parametrize("wrong, hint", [
    (all_shared_tokens, "only *full* blocks are cached"),
    (no_last_token_rule, "last token is always computed"),
    (previous_only, "*every* earlier request"),
    (unchained, "and of everything before it"),
    (rounded_up, "round down to whole blocks"),
    (first_not_zero, "empty cache"),
    (earlier_less_last, "only the *new* prompt stops one token short"),  # (both passed every case before)
    (longest_only, "*every* earlier request"),
    (in_blocks, "you counted blocks"),
    (two_short, "off by one"),
    (summed, "the matches overlap rather than add"),  # (was the generic hint)
    (blocks_anywhere, "at another place in an earlier prompt are another block"),  # (passed every case)
    (cuts_the_prompts, "predict changed the prompts it was given"),  # (was told the earlier prompts' rule)
    (lambda prompts, bs: right_reuse(prompts, 16), "not a number of your own"),  # vLLM's 16 typed in (was generic)
    (lambda prompts, bs: [right_reuse(prompts[:prompts.index(p) + 1], bs)[-1] for p in prompts],  # (was generic)
     "finds the first copy"),  # each prompt's earlier requests found with prompts.index
])
def test_prefix_reuse_names_the_missed_rule(model, capsys, wrong, hint):
    ok, out = run(ex08.check_prefix_reuse, wrong, model, capsys=capsys)
    assert not ok and out.startswith("✗") and hint in out, out


@pytest.mark.parametrize("answer, says", [
    (right_reuse([[1, 2]], 4), "pass your function itself"),
    (lambda prompts, bs: [0], "should return"),
    (lambda prompts, bs: [0.0] * len(prompts), "should return"),
    (lambda prompts, bs: 1 / 0, "raised ZeroDivisionError"),
    (lambda prompts, bs: None, "not done yet"),  # the student copy's stub
    (lambda prompts, bs: 3, "one number per prompt"),
])
def test_prefix_reuse_refuses_malformed_answers(model, capsys, answer, says):
    ok, out = run(ex08.check_prefix_reuse, answer, model, capsys=capsys)
    assert not ok and says in out, out


def test_reference_rule_matches_the_engine_on_random_prompts(model):
    g = random.Random(3)
    base = [g.randrange(10, 90) for _ in range(12)]
    prompts = [base[:g.randint(1, 12)] + [g.randrange(10, 90) for _ in range(g.randint(0, 5))] for _ in range(6)]
    assert ex08.engine_cached_tokens(model, prompts, 2) == right_reuse(prompts, 2)


# -- notebook 08, exercise 2: the acceptance rule ------------------------------------------------------

def right_accept(drafts, targets):
    out = []
    for d, t in zip(drafts, targets):
        out.append(t)
        if d != t:
            return out
    return out + [targets[len(drafts)]]


def no_bonus(drafts, targets):
    out = right_accept(drafts, targets)
    return out[:len(drafts)] if len(out) == len(drafts) + 1 else out


def keeps_the_guess(drafts, targets):
    out = []
    for d, t in zip(drafts, targets):
        out.append(d)
        if d != t:
            return out
    return out + [targets[len(drafts)]]


def accepted_only(drafts, targets):
    out = []
    for d, t in zip(drafts, targets):
        if d != t:
            return out
        out.append(t)
    return out + [targets[len(drafts)]]


def goes_on(drafts, targets):
    return list(targets)


def mismatch_at_zero_when_none(drafts, targets):
    """The first mismatch's index, defaulting to 0 where there is none (every guess right)."""
    j = next((i for i, (d, t) in enumerate(zip(drafts, targets)) if d != t), 0)
    return targets[:j + 1]


def test_accept_is_checked_against_the_engine(capsys):
    ok, out = run(ex08.check_accept, right_accept, capsys=capsys)
    assert ok and "kept the output exact" in out


@pytest.mark.parametrize("wrong, hint", [
    (no_bonus, "bonus token"),
    (keeps_the_guess, "keeps the wrong guess"),
    (accepted_only, "at least one token more than it accepts"),
    (goes_on, "stop at the first mismatch"),
    (lambda d, t: [], "section 6's picture"),
    (lambda d, t: [] if not d else right_accept(d, t), "plain decode"),  # (was told about the bonus token)
    (lambda d, t: [x for x, _ in zip(d, [y for y in t[1:]])][:next((i for i, (x, y) in enumerate(zip(d, t[1:]))
                                                                     if x != y), len(d))] +
     [t[next((i for i, (x, y) in enumerate(zip(d, t[1:])) if x != y), len(d))]], "one position later"),
    (lambda d, t: [t.pop(0) for _ in range(len(right_accept(d, t)))], "changed the lists it was given"),
    (mismatch_at_zero_when_none, "there is no mismatch at all"),  # (was told it compared one position later)
])
def test_accept_names_the_missed_rule(capsys, wrong, hint):
    ok, out = run(ex08.check_accept, wrong, capsys=capsys)
    assert not ok and hint in out, out
    assert "targets[" not in out and "drafts[" not in out, "a hint names the misconception, never the index"


def test_accept_refuses_malformed_answers(capsys):
    ok, out = run(ex08.check_accept, right_accept([1], [1, 2]), capsys=capsys)
    assert not ok and "pass your function itself" in out
    ok, out = run(ex08.check_accept, lambda d, t: None, capsys=capsys)  # the student copy's stub
    assert not ok and "not done yet" in out
    ok, out = run(ex08.check_accept, lambda d, t: 3, capsys=capsys)
    assert not ok and "should return a list" in out
    ok, out = run(ex08.check_accept, lambda d, t: t[len(t)], capsys=capsys)
    assert not ok and "raised IndexError" in out


def test_the_engine_really_runs_the_learners_rule(capsys):
    unit_cases = len(ex08.ACCEPT_CASES) + ex08.NUM_RANDOM_ACCEPT_CASES

    class RightOnlyOnTheUnitCases:
        calls = 0

        def __call__(self, drafts, targets):
            self.calls += 1
            return right_accept(drafts, targets) if self.calls <= unit_cases else list(targets)

    rule = RightOnlyOnTheUnitCases()
    ok, out = run(ex08.check_accept, rule, capsys=capsys)
    assert rule.calls > unit_cases  # the engine called it
    assert not ok and "inside the engine your rule changed the generated tokens" in out


# -- notebook 09: the handover ----------------------------------------------------------------------

def right_handover(prompt_len, config, bs, kv_dtype, link):
    per_head = config.head_dim + 4 if kv_dtype == "int8" else 4 * config.head_dim
    nbytes = math.ceil(prompt_len / bs) * bs * 2 * config.num_hidden_layers * config.num_key_value_heads * per_head
    return nbytes, nbytes / link


def scaled(factor_bytes=1.0, factor_seconds=1.0, tokens=None, per_head=None, heads=None):
    def handover(prompt_len, config, bs, kv_dtype, link):
        h = config.num_key_value_heads if heads is None else getattr(config, heads)
        ph = (per_head or (lambda c, d: c.head_dim + 4 if d == "int8" else 4 * c.head_dim))(config, kv_dtype)
        n = math.ceil(prompt_len / bs) * bs if tokens is None else tokens(prompt_len, bs)
        nbytes = int(n * 2 * config.num_hidden_layers * h * ph * factor_bytes)
        return nbytes, nbytes / link * factor_seconds
    return handover


def test_handover_accepts_the_right_bytes_and_seconds(model, capsys):
    ok, out = run(ex09.check_handover, right_handover, model, 30, capsys=capsys)
    assert ok and f"all {len(ex09.CASES) + 2} handovers" in out


@pytest.mark.parametrize("wrong, hint", [
    (scaled(tokens=lambda n, bs: n), "whole blocks"),
    (scaled(tokens=lambda n, bs: math.ceil((n + 1) / bs) * bs), "first new token"),
    (scaled(factor_bytes=0.5), "keys *and* values"),
    (scaled(heads="num_attention_heads"), "only the KV heads are cached"),
    (scaled(per_head=lambda c, d: c.head_dim if d == "int8" else 4 * c.head_dim), "float32 scale"),
    (scaled(per_head=lambda c, d: 4 * c.head_dim), "1 byte"),
    (scaled(factor_bytes=8), "bytes, not bits"),
    (scaled(factor_seconds=8), "no factor 8"),
    (scaled(factor_seconds=1 / 8), "no factor 8"),
    (scaled(factor_seconds=1000), "the link time in another unit"),  # milliseconds (was the formula restated)
    (scaled(factor_seconds=1e-9), "the link time in another unit"),
    (scaled(tokens=lambda n, bs: n // bs * bs), "rounded down"),
    (scaled(tokens=lambda n, bs: math.ceil(n / bs)), "counted blocks, not the tokens"),
    (scaled(per_head=lambda c, d: c.head_dim + 4 if d == "int8" else 2 * c.head_dim), "2 is float16's"),
    (scaled(per_head=lambda c, d: c.hidden_size // c.num_key_value_heads * (1 if d == "int8" else 4)
            + (4 if d == "int8" else 0)), "each config.head_dim wide"),
    (scaled(per_head=lambda c, d: (lambda w: w + 4 if d == "int8" else 4 * w)(c.hidden_size // c.num_attention_heads)),
     "need not be hidden_size / num_attention_heads"),  # right wherever the heads are hidden / heads wide
    (scaled(per_head=lambda c, d: c.head_dim + 2 if d == "int8" else 4 * c.head_dim), "float32 scale, 4 bytes"),
    (scaled(per_head=lambda c, d: c.head_dim + 8 if d == "int8" else 4 * c.head_dim), "scales were counted twice"),
    (scaled(per_head=lambda c, d: c.head_dim + 4 / c.num_key_value_heads if d == "int8" else 4 * c.head_dim),
     "float32 scale, 4 bytes"),  # one scale per token, not per token and head
    (lambda n, c, bs, d, link: right_handover(n, c, bs, d, link)[::-1], "(bytes, seconds), in that order"),
    (lambda n, c, bs, d, link: (right_handover(n, c, bs, d, link)[0], link / right_handover(n, c, bs, d, link)[0]),
     "upside down"),
])
def test_handover_names_the_missed_factor(model, capsys, wrong, hint):
    ok, out = run(ex09.check_handover, wrong, model, 30, capsys=capsys)
    assert not ok and hint in out, out


def test_a_mistake_the_check_does_not_know_gets_its_size_not_the_formula(model, capsys):
    """The fallback hint spelt out the whole formula ("bytes = whole blocks of the prompt x block_size x ...")."""
    ok, out = run(ex09.check_handover, scaled(tokens=lambda n, bs: math.ceil((n - 1) / bs) * bs), model, 30,
                  capsys=capsys)
    assert not ok and "times the bytes the server moved" in out and "×" not in out and "block_size" not in out.split(
        "Hint:")[-1], out


def test_handover_per_layer_hint(capsys):
    def one_layer(n, config, bs, kv_dtype, link):
        nbytes = right_handover(n, config, bs, kv_dtype, link)[0] // config.num_hidden_layers
        return nbytes, nbytes / link
    three_layers = ex09.small_model("mqa")  # with 2 layers, "one layer" and "K or V only" look the same
    ok, out = run(ex09.check_handover, one_layer, three_layers, 30, capsys=capsys)
    assert not ok and "every layer has its own keys and values" in out


def test_handover_never_prints_the_expected_bytes(model, capsys):
    expected = right_handover(30, model.config, 16, None, 10e9)[0]
    ok, out = run(ex09.check_handover, scaled(tokens=lambda n, bs: n), model, 30, capsys=capsys)
    assert not ok and f"{expected:,}" not in out and str(expected) not in out


@pytest.mark.parametrize("answer, says", [
    (right_handover, None),
    (lambda *a: 5, "did not return (bytes, seconds)"),
    (lambda *a: ("5", 1.0), "two numbers"),
    (lambda *a: None, "not done yet"),  # the student copy's stub: no TypeError about unpacking None
])
def test_handover_refuses_malformed_answers(model, capsys, answer, says):
    if says is None:  # not callable: the learner passed the result, not the function
        ok, out = run(ex09.check_handover, right_handover(1, model.config, 16, None, 1e9), model, capsys=capsys)
        assert not ok and "pass your function itself" in out
        return
    ok, out = run(ex09.check_handover, answer, model, capsys=capsys)
    assert not ok and says in out, out


# -- the pictures -----------------------------------------------------------------------------------

def shared_prefix_engine(model):
    system = [10 + i % 70 for i in range(20)]
    eng = Engine(model, None, max_batch_size=3, kv="paged", block_size=4, prefix_caching=True)
    eng.run([Request(system + [7], 2, request_id="warm")])
    reqs = [Request(system + [11 + i], 4, request_id=f"q{i}", ignore_eos=True) for i in range(3)]
    for r in reqs:
        eng.add_request(r)
    eng.step()
    return eng, reqs


def test_block_tables_mark_shared_blocks_with_their_reference_counts(model):
    eng, reqs = shared_prefix_engine(model)
    usage = eng.kv_usage()
    shared = sharing.shared_blocks(usage["block_tables"])
    assert shared and set(shared.values()) == {3}
    refs = eng.kv.manager.allocator.ref_counts
    assert all(refs[b] == n for b, n in shared.items())
    hits = {r.request_id: eng.sequences[r.request_id].num_cached_prompt_tokens for r in reqs}
    ax = sharing.draw_block_tables(usage, ref_counts=refs, cached_tokens=hits)
    assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
    cells = [p for p in ax.patches if (p.get_gid() or "").startswith("block ")]
    assert len(cells) == sum(len(t) for t in usage["block_tables"].values())
    assert sum(1 for p in ax.patches if p.get_gid() == "hit") == sum(h // 4 for h in hits.values())
    assert any(f"×{refs[b]}" in t.get_text() for t in ax.texts for b in shared)
    with pytest.raises(ValueError, match="kv='paged'"):
        sharing.draw_block_tables({"num_blocks": 3})


def test_verify_step_rows_follow_the_acceptance_rule():
    model = ex08.loop_model()
    eng = Engine(model, None, max_batch_size=3, kv="paged", speculative="ngram", num_speculative_tokens=3)
    eng.run([Request([10 + (7 * i + j) % 80 for j in range(6)], 20, request_id=i, ignore_eos=True) for i in range(3)])
    verify = [r for r in eng.records if any(s.num_draft_tokens for s in r.seqs)]
    assert verify
    for rec in verify:
        rows = sharing.verify_rows(rec)
        assert len(rows) == rec.num_tokens
        i = 0
        for s in rec.seqs:
            mine = rows[i:i + s.num_scheduled_tokens]
            i += s.num_scheduled_tokens
            if not s.num_draft_tokens:
                continue
            a = len(s.new_token_ids) - 1
            assert sum("accepted" in w and "rejected" not in w for _, w in mine) == a + (a == s.num_draft_tokens)
            assert ("bonus" in mine[a][1]) == (a == s.num_draft_tokens)
    ax = sharing.draw_verify_step(verify[0], context=2)
    assert "Verify step" in ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
    assert ax.images[0].get_array().shape[0] == verify[0].num_tokens
    plain = next(r for r in eng.records if not any(s.num_draft_tokens for s in r.seqs))
    with pytest.raises(ValueError, match="verified no guesses"):
        sharing.draw_verify_step(plain)


def test_token_gaps_plot_every_gap(model):
    out = Engine(model, None, max_batch_size=2, kv="paged").run(
        [Request([10, 11, 12], 6, request_id=i, ignore_eos=True) for i in range(3)])
    ends, gaps = sharing.token_gaps(out)
    assert len(gaps) == sum(len(c.token_times) - 1 for c in out) == len(ends)
    assert min(gaps) >= 0 and max(gaps) == pytest.approx(max(summarize([c])["itl_p99"] or 0 for c in out), rel=0.1)
    ax = sharing.plot_token_gaps({"run": out}, marks=[0.0])
    assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
    assert len(ax.collections[0].get_offsets()) == len(gaps)


@pytest.mark.parametrize("returns", [
    lambda d, t: torch.tensor(right_accept(d, t)),  # a tensor: not the list of ints the engine appends
    lambda d, t: __import__("numpy").array(right_accept(d, t)),
    lambda d, t: [str(x) for x in right_accept(d, t)],
    lambda d, t: [x + 0.5 for x in right_accept(d, t)],
    lambda d, t: (x for x in [t[0], 1 / 0]),  # a generator that raises when consumed
])
def test_accept_answers_of_the_wrong_kind_get_a_hint_not_a_traceback(returns, capsys):
    ok, out = run(ex08.check_accept, returns, capsys=capsys)
    assert not ok and out.startswith("✗")


# -- notebook 09, section 4: async scheduling drawn from step timings -------------------------------------

def _timed_record(step, schedule, forward, update):
    from types import SimpleNamespace
    return SimpleNamespace(step=step, timings={"schedule": schedule, "forward": forward, "update": update})


def test_overlap_stats_count_what_the_timings_show():
    from cbteach.viz.overlap import overlap_stats
    serial = [_timed_record(i, (3 * i, 3 * i + 0.5), (3 * i + 0.5, 3 * i + 2.5), (3 * i + 2.5, 3 * i + 3)) for i in range(4)]
    s = overlap_stats(serial)
    assert (s["steps"], s["overlapped"]) == (4, 0) and s["forward_s"] == 8 and s["span_s"] == 11 and s["gaps_s"] == 3
    # async: step i + 1 is planned while step i's forward runs, and the forwards follow each other
    overlapped = [_timed_record(i, (2 * i - 1.5 if i else 0, 2 * i - 1 if i else 0.5), (2 * i + 0.5, 2 * i + 2.5),
                                (2 * i + 2.5, 2 * i + 3)) for i in range(4)]
    s = overlap_stats(overlapped)
    assert s["overlapped"] == 3 and s["gaps_s"] == 0 and s["span_s"] == s["forward_s"] == 8
    with pytest.raises(ValueError, match="no step record carries timings"):
        overlap_stats([_timed_record(0, (0, 1), (1, 2), (2, 3))][:0])


def test_overlap_timelines_are_drawn_from_a_real_run_in_both_modes(model):
    from cbteach.viz.overlap import overlap_stats, plot_overlap
    records, outputs = {}, {}
    for name, flag in (("synchronous", False), ("async scheduling", True)):
        eng = Engine(model, None, max_batch_size=4, kv="paged", async_scheduling=flag)
        reqs = [Request([10 + i, 20 + i, 30 + i], 12, request_id=i, ignore_eos=True) for i in range(4)]
        outputs[name] = [c.output_ids for c in eng.run(reqs)]
        records[name] = eng.records
    assert outputs["synchronous"] == outputs["async scheduling"]
    assert overlap_stats(records["synchronous"])["overlapped"] == 0  # one after another, whatever the machine
    for recs in records.values():
        for r in recs:  # each phase ends after it starts; a step's forward comes after its own schedule
            assert all(a <= b for a, b in r.timings.values())
            assert r.timings["schedule"][1] <= r.timings["forward"][0] + 1e-9
    axs = plot_overlap(records, steps=(2, 6), title="test")
    assert len(axs) == 2 and all(ax.get_title() and ax.get_xlabel() and ax.get_yticklabels() for ax in axs)
    with pytest.raises(ValueError, match="no step in"):
        plot_overlap({"synchronous": records["synchronous"]}, steps=(500, 501))
