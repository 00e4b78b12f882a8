"""The self-check of notebook 01 runs the learner's static wave against per-prompt ``generate`` and the
real static batcher's passes: a right wave passes, and each typical mistake fails with a hint that names
it -- never the tokens or the counts."""
import pytest
import torch
from conftest import EOS, tiny_model  # noqa: F401

from cbteach.exercises import ex01

PROMPTS = [[7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [18, 19, 20, 21, 22, 23, 24]]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def make_wave(pad_left=True, prefill_mask=True, decode_mask=True, grow_mask=True, positions=True,
              shared_positions=False, width_extra=0, extra_pass=False, skip_prefill_token=False,
              keep_after_eos=False, stop_at_first_eos=False, run_to_cap=False, use_cache=True, none=False,
              drop_eos=False, pad_positions=False, zero_mask_column=False, model_eos=False, unclamped=False,
              from_one=False):
    """The notebook's solution, with one mistake switched on."""
    def static_wave(model, prompts, max_new_tokens, eos_id):
        if none:
            return None
        if model_eos:  # the model's own EOS, not the id the wave is given
            eos_id = model.config.eos_token_id
        n, width = len(prompts), max(len(p) for p in prompts) + width_extra
        dev = model.device

        def row(p, pad, real):
            return [pad] * (width - len(p)) + real if pad_left else real + [pad] * (width - len(p))

        ids = torch.tensor([row(p, eos_id, p) for p in prompts], device=dev)
        mask = torch.tensor([row(p, 0, [1] * len(p)) for p in prompts], device=dev)
        pos = mask.cumsum(-1) - 1 if unclamped else (mask.cumsum(-1) - 1).clamp(min=0)
        if from_one:  # each row's first real token numbered 1
            pos = mask.cumsum(-1)
        if pad_positions:  # every row numbered from the rectangle's first column, pads included
            pos = torch.arange(width, device=dev).repeat(n, 1)
        outs, done, cache, step = [[] for _ in prompts], [False] * n, None, 0
        seqs = ids
        with torch.no_grad():
            if skip_prefill_token:  # the prefill only fills the cache; its logits are thrown away
                out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
                cache, ids, pos = out.cache, ids[:, -1:], pos[:, -1:]
                mask = torch.cat([mask, torch.ones(n, 1, dtype=mask.dtype, device=dev)], dim=1)
            while True:
                kw = {}
                if (step == 0 and prefill_mask) or (step > 0 and decode_mask):
                    kw["attention_mask"] = mask if use_cache or step == 0 else None
                if positions:
                    kw["position_ids"] = pos
                if use_cache:
                    out = model(input_ids=ids, cache=cache, use_cache=True, **kw)
                    cache = out.cache
                else:
                    kw["attention_mask"] = mask
                    kw.pop("position_ids", None)
                    out = model(input_ids=seqs, **kw)
                chosen = out.logits[:, -1].argmax(-1).tolist()
                step += 1
                for i in range(n):
                    if not done[i] or keep_after_eos:
                        if len(outs[i]) < max_new_tokens and not (drop_eos and chosen[i] == eos_id):
                            outs[i].append(chosen[i])
                    if not done[i]:
                        done[i] = chosen[i] == eos_id or len(outs[i]) == max_new_tokens
                if run_to_cap:
                    if step == max_new_tokens:
                        return outs
                elif stop_at_first_eos and any(done) or all(done) and (not extra_pass or step > max(map(len, outs))):
                    return outs
                feed = [[eos_id if done[i] else outs[i][-1]] for i in range(n)]
                ids = torch.tensor(feed, device=dev)
                seqs = torch.cat([seqs, ids], dim=1)
                if grow_mask:
                    new = torch.zeros if zero_mask_column else torch.ones
                    mask = torch.cat([mask, new(n, 1, dtype=mask.dtype, device=dev)], dim=1)
                if shared_positions:  # every row numbered by the rectangle's columns
                    pos = torch.full((n, 1), mask.shape[1] - 1, device=dev)
                else:
                    pos = pos[:, -1:] + 1
    return static_wave


def test_the_solution_passes(model, capsys):
    assert ex01.check_static_wave(make_wave(), model, PROMPTS, 10, EOS)
    out = capsys.readouterr().out
    assert out.startswith("✓") and "all 3 cases" in out


def test_rows_of_tensors_or_arrays_pass(model, capsys):
    """Rows of 0-d tensors (``.tolist()`` left out) or NumPy arrays were "static_wave returned list" -- it had."""
    import numpy as np

    wave = make_wave()

    def tensors(*args):
        return [[torch.tensor(t) for t in row] for row in wave(*args)]

    def arrays(*args):
        return [np.array(row) for row in wave(*args)]

    for answer in (tensors, arrays):
        assert ex01.check_static_wave(answer, model, PROMPTS, 10, EOS), capsys.readouterr().out


def test_engine_passes_come_from_the_static_batcher(model):
    passes = ex01.engine_passes(model, PROMPTS, 6, EOS)
    assert passes[0] == (4, 7) and all(p == (4, 1) for p in passes[1:])
    lengths = [len(ex01.reference(model, p, 6, EOS)) for p in PROMPTS]
    assert len(passes) == max(lengths)  # the wave lasts as long as its longest answer
    assert model.generation_config.eos_token_id == EOS  # the check leaves the model's settings as they were


def test_the_gpt2_case_has_a_request_that_finishes_early(model):
    *_, (where, m, ps, n, eos) = ex01._cases(model, PROMPTS, 10, EOS)
    lengths = [len(ex01.reference(m, p, n, eos)) for p in ps]
    assert min(lengths) < max(lengths) < n  # someone waits at the barrier, and the wave ends before the cap


WRONG = [
    (dict(positions=False), "position_ids were not passed"),
    (dict(shared_positions=True), "decode pass's position id is not the count"),
    (dict(pad_left=False), "pad on the left"),
    (dict(prefill_mask=False), "prefill got no attention mask"),
    (dict(decode_mask=False), "decode pass got no attention mask"),
    (dict(grow_mask=False), "grow with every step"),
    (dict(width_extra=1), "wrong width"),
    (dict(extra_pass=True), "one forward pass too many"),
    (dict(skip_prefill_token=True), "prefill's logits already give"),
    (dict(keep_after_eos=True), "thrown away"),
    (dict(stop_at_first_eos=True), "wait at the barrier"),
    (dict(run_to_cap=True), "kept stepping"),
    (dict(use_cache=False), "more than one token per row"),
    (dict(none=True), "not done yet"),
    (dict(drop_eos=True), "generate keeps the EOS token"),
    (dict(pad_positions=True), "prefill's position ids count from the pads"),
    (dict(from_one=True), "position ids count from 1: a row's first real token is its position 0"),
    (dict(zero_mask_column=True), "hides the token it feeds"),
    (dict(model_eos=True), "the id it is given"),
    (dict(unclamped=True), "a position id is negative"),
]


@pytest.mark.parametrize("mistake, words", WRONG, ids=[w for _, w in WRONG])
def test_each_mistake_fails_with_its_hint(model, capsys, mistake, words):
    assert not ex01.check_static_wave(make_wave(**mistake), model, PROMPTS, 10, EOS)
    out = capsys.readouterr().out
    assert out.startswith("✗") and words in out, out


def _one_at_a_time(model, prompts, max_new_tokens, eos_id):
    outs = []
    for p in prompts:
        outs.append(make_wave()(model, [p], max_new_tokens, eos_id)[0])
    return outs


def _sorted_by_length(model, prompts, max_new_tokens, eos_id):
    """Pads less by sorting the prompts longest first -- and returns the answers in that order."""
    return make_wave()(model, sorted(prompts, key=len, reverse=True), max_new_tokens, eos_id)


def _calls_generate(model, prompts, max_new_tokens, eos_id):
    return [model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens)[0].tolist() for p in prompts]


@pytest.mark.parametrize("fn, words", [
    (_one_at_a_time, "separate passes"),
    (_sorted_by_length, "every request's tokens are there, in another order"),
    (_calls_generate, "called model.generate"),
    (lambda m, p, n, e: 1 / 0, "raised ZeroDivisionError"),
    (lambda m, p, n, e: [[1.5]] * len(p), "one list of new token ids"),
    (lambda m, p, n, e: [[1]], "one list of new token ids"),
    (lambda m, p, n, e: [[1]] * len(p), "saw no forward pass"),
    ("static_wave", "pass your function itself"),
])
def test_other_wrong_answers_give_a_hint_not_a_traceback(model, capsys, fn, words):
    assert not ex01.check_static_wave(fn, model, PROMPTS, 10, EOS)
    out = capsys.readouterr().out
    assert out.startswith("✗") and words in out, out
    assert not hasattr(model, "generate") or "generate" not in model.__dict__  # the bar is lifted


def test_position_mistakes_are_caught_by_the_learned_positions_case_only(model, capsys):
    # a RoPE model sees distances only, so a left-padded row needs no position ids there: the first
    # two cases (Llama) pass without them, and the GPT-2 case is where the check catches it
    assert not ex01.check_static_wave(make_wave(positions=False), model, PROMPTS, 10, EOS)
    assert "GPT-2" in capsys.readouterr().out
    wrong = make_wave(positions=False)
    for where, m, ps, n, eos in ex01._cases(model, PROMPTS, 10, EOS)[:2]:
        assert wrong(m, ps, n, eos) == [ex01.reference(m, p, n, eos) for p in ps]
