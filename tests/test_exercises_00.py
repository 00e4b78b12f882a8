"""The self-check of notebook 00 (greedy decoding with a KV cache) accepts a right loop, on more than one
architecture, and names what is wrong in the usual wrong ones -- without ever showing the right tokens
or the right count."""
import pytest
import torch

from cbteach.exercises.ex00 import check_greedy_decode, generate_with_work
from conftest import EOS, tiny_model

PROMPT = [3, 7, 11, 2, 9, 4]


def ids_for(model):
    return torch.tensor([PROMPT], device=model.device)


# -- a right answer, and wrong ones a learner plausibly writes -------------------------------------------

def right(model, input_ids, max_new_tokens, eos_id):
    new, cache, x = [], None, input_ids  # prefill: the whole prompt, no cache yet
    for _ in range(max_new_tokens):
        out = model(input_ids=x, cache=cache, use_cache=True)
        cache = out.cache
        next_id = out.logits[0, -1].argmax().item()
        new.append(next_id)
        if next_id == eos_id:
            break
        x = torch.tensor([[next_id]], device=model.device)  # decode: only the new token
    return new


def old_name(model, input_ids, max_new_tokens, eos_id):
    """The same loop with the pre-transformers-5 keyword, past_key_values: also right."""
    new, past, x = [], None, input_ids
    for _ in range(max_new_tokens):
        out = model(input_ids=x, past_key_values=past, use_cache=True)
        past = out.cache
        new.append(out.logits[0, -1].argmax().item())
        if new[-1] == eos_id:
            break
        x = torch.tensor([[new[-1]]], device=model.device)
    return new


def no_cache(model, input_ids, max_new_tokens, eos_id):
    seq, new = input_ids, []
    for _ in range(max_new_tokens):
        next_id = model(input_ids=seq).logits[0, -1].argmax().item()
        new.append(next_id)
        if next_id == eos_id:
            break
        seq = torch.cat([seq, torch.tensor([[next_id]], device=model.device)], dim=1)
    return new


def cache_dropped(model, input_ids, max_new_tokens, eos_id):
    new, x = [], input_ids
    for _ in range(max_new_tokens):
        new.append(model(input_ids=x, use_cache=True).logits[0, -1].argmax().item())
        if new[-1] == eos_id:
            break
        x = torch.tensor([[new[-1]]], device=model.device)
    return new


def refeeds_with_cache(model, input_ids, max_new_tokens, eos_id):
    new, cache, seq = [], None, input_ids
    for _ in range(max_new_tokens):
        out = model(input_ids=seq, cache=cache, use_cache=True)
        cache = out.cache
        new.append(out.logits[0, -1].argmax().item())
        if new[-1] == eos_id:
            break
        seq = torch.cat([seq, torch.tensor([[new[-1]]], device=model.device)], dim=1)
    return new


def ignores_eos(model, input_ids, max_new_tokens, eos_id):
    return right(model, input_ids, max_new_tokens, eos_id=-1)


def drops_eos(model, input_ids, max_new_tokens, eos_id):
    return [t for t in right(model, input_ids, max_new_tokens, eos_id) if t != eos_id]


def one_pass_too_many(model, input_ids, max_new_tokens, eos_id):
    out = model(input_ids=input_ids, use_cache=True)
    new = []
    for _ in range(max_new_tokens):
        new.append(out.logits[0, -1].argmax().item())
        out = model(input_ids=torch.tensor([[new[-1]]], device=model.device), cache=out.cache, use_cache=True)
        if new[-1] == eos_id:
            break
    return new


def first_position(model, input_ids, max_new_tokens, eos_id):
    out = model(input_ids=input_ids, use_cache=True)
    return [out.logits[0, 0].argmax().item()] * max_new_tokens


def with_prompt(model, input_ids, max_new_tokens, eos_id):
    return input_ids[0].tolist() + right(model, input_ids, max_new_tokens, eos_id)


def calls_generate(model, input_ids, max_new_tokens, eos_id):
    return model.generate(input_ids, max_new_tokens=max_new_tokens)[0].tolist()


def stub(model, input_ids, max_new_tokens, eos_id):
    ...  # the student copy's stub: returns None


def raises(model, input_ids, max_new_tokens, eos_id):
    return model(input_ids[0]).logits  # a 1-D input


def models_own_eos(model, input_ids, max_new_tokens, eos_id):
    """Stops on the model's EOS, not on the eos_id it is given."""
    return right(model, input_ids, max_new_tokens, model.config.eos_token_id)


def index_error(model, input_ids, max_new_tokens, eos_id):
    new = right(model, input_ids, max_new_tokens, eos_id)
    return [new[i + 1] for i in range(len(new))]  # one past the end


def _loop(model, input_ids, max_new_tokens, eos_id, pick=lambda logits: logits[0, -1].argmax().item(),
          feed=lambda t, model: torch.tensor([[t]], device=model.device), extra=lambda x, step, cached: {}):
    """The right loop, with the token's choice, its feeding and the forward's other arguments swappable."""
    new, cache, x, cached = [], None, input_ids, 0
    for step in range(max_new_tokens):
        out = model(input_ids=x, cache=cache, use_cache=True, **extra(x, step, cached))
        cached += x.shape[-1]
        cache, next_id = out.cache, pick(out.logits)
        new.append(next_id)
        if next_id == eos_id:
            break
        x = feed(next_id, model)
    return new


def positions_from_zero(model, input_ids, max_new_tokens, eos_id):
    """Decode steps numbered from 0 (the prompt's length forgotten): passes on a model that barely notices."""
    return _loop(model, input_ids, max_new_tokens, eos_id,
                 extra=lambda x, step, cached: {"position_ids": torch.tensor([[step]], device=model.device)}
                 if step else {})


def mask_of_the_step(model, input_ids, max_new_tokens, eos_id):
    """attention_mask=torch.ones_like(x) on every pass: a decode step's mask covers its one token only."""
    return _loop(model, input_ids, max_new_tokens, eos_id, extra=lambda x, step, cached: {"attention_mask": torch.ones_like(x)})


def zero_mask(model, input_ids, max_new_tokens, eos_id):
    """attention_mask=torch.zeros(...) of the right width: 0 taken for "attend" (the ones a tokenizer gives, inverted)."""
    return _loop(model, input_ids, max_new_tokens, eos_id, extra=lambda x, step, cached: {
        "attention_mask": torch.zeros(1, cached + x.shape[-1], dtype=torch.long, device=model.device)})


def flat_argmax(model, input_ids, max_new_tokens, eos_id):
    return _loop(model, input_ids, max_new_tokens, eos_id, pick=lambda logits: logits.argmax().item())


def one_d_ids(model, input_ids, max_new_tokens, eos_id):
    return _loop(model, input_ids, max_new_tokens, eos_id, feed=lambda t, model: torch.tensor([t], device=model.device))


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt2"])
def model(request):
    return tiny_model(request.param)


@pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")  # old_name uses the old keyword
def test_right_loop_passes_on_each_architecture(model, capsys):
    assert check_greedy_decode(right, model, ids_for(model), 20, EOS)
    out = capsys.readouterr().out
    assert out.startswith("✓") and f"{len(PROMPT)} + " in out
    assert check_greedy_decode(old_name, model, ids_for(model), 20, EOS)


def test_the_check_measures_generate_live(model):
    """The reference work is what generate really fed: the prompt once, then one position per step."""
    tokens, calls = generate_with_work(model, ids_for(model), 10, EOS)
    assert [fed for fed, _, _ in calls] == [len(PROMPT)] + [1] * (len(tokens) - 1)
    _, calls = generate_with_work(model, ids_for(model), 10, EOS, use_cache=False)
    assert [fed for fed, _, _ in calls] == [len(PROMPT) + k for k in range(len(calls))]


HINTS = [
    (no_cache, "whole sequence through the model again"),
    (cache_dropped, "without the cache"),
    (refeeds_with_cache, "earlier tokens again together with the cache"),
    (ignores_eos, "kept going after EOS"),
    (drops_eos, "left out the EOS token"),
    (one_pass_too_many, "one forward pass too many"),
    (with_prompt, "returned the prompt too"),
    (calls_generate, "called model.generate"),
    (stub, "not done yet"),
    (raises, "raised"),
    (index_error, "raised IndexError: list index out of range (line"),  # the learner's line, named
    (positions_from_zero, "position_ids do not give its token's position"),
    (mask_of_the_step, "attention_mask does not cover the cache plus the token fed"),
    (flat_argmax, "token id past the vocabulary"),
    (one_d_ids, "input_ids were not 2-D"),
    (zero_mask, "attention_mask has a 0: a 0 hides that position"),  # (was "other tokens" and a generic hint)
]


@pytest.mark.parametrize("wrong, hint", HINTS, ids=[w.__name__ for w, _ in HINTS])
def test_wrong_loops_get_the_right_hint_and_not_the_answer(model, wrong, hint, capsys):
    assert not check_greedy_decode(wrong, model, ids_for(model), 20, EOS)
    out = capsys.readouterr().out
    assert out.startswith("✗") and hint in out, out
    for ids, n, eos in [(ids_for(model), 20, EOS), (ids_for(model), 12, EOS)]:
        expected, calls = generate_with_work(model, ids, n, eos)
        assert str(expected) not in out and str(expected)[1:-1] not in out  # never the right tokens
    assert "expected" not in out.lower()


def test_a_loop_that_stops_on_the_models_eos_not_on_eos_id_is_caught(bierce, capsys):
    """Where the notebook's eos_id is the model's own EOS, only the check's own stop case can tell a loop that
    stops on ``model.config.eos_token_id`` from a right one: it stops half-way (on the notebook's prompt the
    last of 12 tokens was picked once, where stopping and not stopping give the same list)."""
    model, tok = bierce
    ids = tok("ABSURDITY, n.", return_tensors="pt")["input_ids"]
    assert check_greedy_decode(right, model, ids, 100, tok.eos_token_id)
    assert not check_greedy_decode(models_own_eos, model, ids, 100, tok.eos_token_id)
    assert "kept going after EOS" in capsys.readouterr().out


def test_wrong_first_token_is_named_without_the_value(capsys):
    model = tiny_model("llama")
    assert not check_greedy_decode(first_position, model, ids_for(model), 20, EOS)
    out = capsys.readouterr().out
    right_first = right(model, ids_for(model), 1, EOS)[0]
    assert "first new token already differs" in out and str(right_first) not in out.split("model.generate (", 1)[1]


def test_no_cache_hint_shows_only_the_learners_own_count(capsys):
    model = tiny_model("llama")
    assert not check_greedy_decode(no_cache, model, ids_for(model), 20, EOS)
    out = capsys.readouterr().out
    _, calls = generate_with_work(model, ids_for(model), 20, EOS)
    assert str(sum(fed for fed, _, _ in calls)) not in out  # generate's count (the answer) is not shown


def test_not_a_function(capsys):
    model = tiny_model("llama")
    assert not check_greedy_decode([1, 2, 3], model, ids_for(model), 5, EOS)
    assert "pass your function itself" in capsys.readouterr().out


def test_the_model_is_left_as_it_was():
    model = tiny_model("llama")
    check_greedy_decode(calls_generate, model, ids_for(model), 5, EOS)
    assert "generate" not in vars(model) and not model._forward_pre_hooks
    assert model.generate(ids_for(model), max_new_tokens=2, do_sample=False).shape[1] == len(PROMPT) + 2


def test_a_generator_answer_and_a_deleted_generate(model, capsys):
    def as_generator(model, input_ids, max_new_tokens, eos_id):
        yield from right(model, input_ids, max_new_tokens, eos_id)

    def deletes_generate(model, input_ids, max_new_tokens, eos_id):
        del model.generate
        return right(model, input_ids, max_new_tokens, eos_id)

    assert check_greedy_decode(as_generator, model, ids_for(model), 20, EOS)
    assert capsys.readouterr().out.startswith("✓")
    check_greedy_decode(deletes_generate, model, ids_for(model), 20, EOS)
    assert "Traceback" not in capsys.readouterr().out
    assert "generate" not in vars(model) and callable(model.generate)  # the class's own generate is back


def test_an_exception_in_the_learners_code_names_its_line():
    """A check that stops on the learner's exception says which line of *their* code raised it (the
    deepest frame outside cbteach and the Python installation), not just the error's name."""
    from cbteach.exercises import raised, report, self_check

    def learners_code(xs):
        total = 0
        for i in range(len(xs) + 1):
            total += xs[i]  # one past the end
        return total

    @self_check
    def check(fn):
        return report(fn([1, 2]) == 3, "right", "wrong")

    try:
        learners_code([1, 2])
    except IndexError as err:
        said = raised(err)
    assert said.startswith("IndexError: list index out of range (line ") and "total += xs[i]" in said
    import io
    from contextlib import redirect_stdout
    out = io.StringIO()
    with redirect_stdout(out):
        assert check(learners_code) is False
    assert "total += xs[i]" in out.getvalue() and "of your code" in out.getvalue()
