"""``serve``'s default token budget: a long prompt is prefilled in chunks, so a stream already running is
never stalled behind it (Sarathi-Serve's chunked prefill; vLLM's ``max_num_batched_tokens``).

Counted in engine steps, not seconds: the engine is built with exactly the options ``serve`` gives its
engine cores with no option on the command line (:func:`cbteach.serving.frontend.core_spec`), and we
check that beside a 4,000-token prompt the innocent stream gets a token in *every* step and no step
carries more than the budget -- so the longest it waits between two tokens is one step of at most
``budget`` tokens, whatever the machine's speed. ``--token-budget none`` keeps the old behaviour: one
step carries the whole prompt. The innocent stream's tokens are checked against ``model.generate``.
"""
import pytest

from cbteach import Engine
from cbteach.core.request import Request
from cbteach.serving.frontend import core_spec
from cbteach.serving.server_cli import DEFAULT_TOKEN_BUDGET, parser
from cbteach.serving.workloads import corpus_ids

LONG = 4000


def engine_as_served(bierce, argv):
    spec = core_spec(parser().parse_args(argv))
    model, tok = bierce
    return Engine(model, tok, keep_records=False, **spec.engine_options), spec.engine_options["token_budget"]


def stall(bierce, argv):
    """Per step while the long prompt is in the engine: (tokens scheduled, did the innocent stream get a token)."""
    eng, budget = engine_as_served(bierce, argv)
    ids = corpus_ids(bierce[1])
    eng.add_request(Request(ids[:8], 40, request_id="innocent", ignore_eos=True))
    for _ in range(3):
        eng.step()
    eng.add_request(Request(ids[1000:1000 + LONG], 2, request_id="long", ignore_eos=True))
    steps = []
    while not eng.sequences["long"].status.is_finished and len(steps) < 1000:
        record = eng.step()
        got = [s for s in record.seqs if s.request_id == "innocent" and s.new_token_ids]
        steps.append((sum(s.num_scheduled_tokens for s in record.seqs), bool(got)))
    while eng.has_unfinished():
        eng.step()
    return steps, budget, eng.sequences["innocent"].output_ids


def test_by_default_an_innocent_stream_gets_a_token_every_step_beside_a_4000_token_prompt(bierce):
    from serverkit import make_ref

    steps, budget, innocent = stall(bierce, [])
    assert budget == DEFAULT_TOKEN_BUDGET and budget < LONG
    assert all(got for _, got in steps), [i for i, (_, got) in enumerate(steps) if not got]
    assert max(n for n, _ in steps) <= budget  # the longest gap: one step of at most `budget` tokens
    assert len(steps) >= LONG // budget  # the prompt really went in chunks
    assert innocent == make_ref(*bierce)(corpus_ids(bierce[1])[:8], 40)  # chunking changed no token


def test_token_budget_none_prefills_the_long_prompt_in_one_step_the_stall(bierce):
    steps, budget, _ = stall(bierce, ["--token-budget", "none"])
    assert budget is None
    assert max(n for n, _ in steps) > LONG  # one step carried the whole prompt (and the innocent's token)


@pytest.mark.parametrize("text, expected", [("none", None), ("None", None), ("64", 64)])
def test_token_budget_option(text, expected):
    assert parser().parse_args(["--token-budget", text]).token_budget == expected


@pytest.mark.parametrize("text", ["0", "-3", "lots", "1.5"])
def test_a_bad_token_budget_is_refused_naming_the_option(text, capsys):
    with pytest.raises(SystemExit) as e:
        parser().parse_args(["--token-budget", text])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--token-budget" in err and "'none'" in err
