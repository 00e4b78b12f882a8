"""Sampling parameters: greedy by default; seeded sampling reproducible and independent of the batch."""
import pytest

from cbteach import Engine, Request, SamplingParams, static_batching
from conftest import reference, tiny_model

MODEL = tiny_model("llama")


def test_a_tiny_top_p_is_greedy():
    reqs = [Request([7, 8, 9], 12, sampling_params=SamplingParams(temperature=1.0, top_p=1e-6, seed=3))]
    assert Engine(MODEL, max_batch_size=2).run(reqs)[0].output_ids == reference(MODEL, [7, 8, 9], 12)


@pytest.mark.parametrize("kv", ["concat", "paged"])
def test_seeded_sampling_does_not_depend_on_the_batch(kv):
    params = SamplingParams(temperature=1.3, top_p=0.9, seed=11)
    alone = Engine(MODEL, max_batch_size=1, kv=kv).run([Request([7, 8, 9], 20, sampling_params=params)])
    others = [Request([20 + i, 21], 15, sampling_params=SamplingParams(temperature=0.8, seed=i)) for i in range(3)]
    batched = Engine(MODEL, max_batch_size=4, kv=kv).run(others + [Request([7, 8, 9], 20, sampling_params=params)])
    assert batched[-1].output_ids == alone[0].output_ids
    assert alone[0].output_ids != reference(MODEL, [7, 8, 9], 20)  # it really sampled
    st = static_batching(MODEL, None, others + [Request([7, 8, 9], 20, sampling_params=params)], 4)
    assert st[-1].output_ids == alone[0].output_ids  # static batching samples the same way


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(temperature=float("nan")), dict(top_p=0),
                                 dict(top_p=1.5), dict(seed=1.5), dict(temperature=True)])
def test_bad_sampling_params_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_sampling_params_must_be_the_right_type():
    with pytest.raises(ValueError, match="sampling_params must be a cbteach.SamplingParams"):
        Engine(MODEL, max_batch_size=1).add_request(Request([7], 2, sampling_params={"temperature": 1.0}))
