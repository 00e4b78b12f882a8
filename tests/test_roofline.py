"""The roofline arithmetic of cbteach.perf against counts derived by hand for a tiny shape, its
monotonicity, the ridge batch against a brute-force search, the claim line's format, and the figure."""
import math

import matplotlib
import pytest
import torch

from cbteach.perf import (A100, H100, LLAMA2_7B, T4, Device, ModelShape, claim, decode_step, failed_claims,
                          kv_capacity_batch, measure_device, prefill_step, ridge_batch, timeit)

matplotlib.use("Agg")

# 2 layers, hidden 8, 2 query heads of 4 sharing 1 KV head, MLP 16, vocab 10, 2-byte weights.
TINY = ModelShape("tiny", num_layers=2, hidden=8, num_heads=2, num_kv_heads=1, intermediate=16, vocab=10,
                  bytes_per_param=2)


def test_tiny_shape_by_hand():
    # per layer: Q and O 8x8 each (128), K and V 8x4 each (64), MLP 3 x 8x16 (384)
    assert TINY.layer_params == 576
    assert TINY.matmul_params == 2 * 576 + 10 * 8  # the LM head multiplies every token too
    assert TINY.total_params == 1232 + 80  # plus the embedding table, not tied
    assert TINY.kv_bytes_per_token == 2 * 2 * 4 * 2  # K and V, 2 layers, kv_dim 4, 2 bytes


def test_decode_step_by_hand():
    s = decode_step(TINY, batch=3, context=5)
    # 2 FLOPs per weight per token, 3 tokens; attention: 4 * q_dim (8) * 2 layers per query-key pair, 3 x 6 pairs
    assert s.flops == 2 * 1232 * 3 + 4 * 8 * 2 * 3 * 6
    assert s.weight_bytes == 1232 * 2  # read once, whatever the batch
    assert s.kv_bytes == 3 * 6 * 32  # every sequence's 5 cached tokens and its new one
    assert s.intensity == pytest.approx(s.flops / (s.weight_bytes + s.kv_bytes))


def test_prefill_step_by_hand():
    s = prefill_step(TINY, prompt_len=4)
    assert s.flops == 2 * 1232 * 4 + 4 * 8 * 2 * (1 + 2 + 3 + 4)  # causal: token i meets i + 1 keys
    assert s.weight_bytes == 1232 * 2 and s.kv_bytes == 4 * 32


def test_llama2_7b_has_about_seven_billion_weights_and_half_a_mebibyte_of_kv_per_token():
    assert 6.7e9 < LLAMA2_7B.total_params < 6.8e9
    assert LLAMA2_7B.kv_bytes_per_token == 2 * 32 * 4096 * 2 == 512 * 1024


def test_decode_at_batch_one_in_16_bit_is_about_one_flop_per_byte():
    assert decode_step(LLAMA2_7B, 1, 0).intensity == pytest.approx(1.0, rel=0.01)


@pytest.mark.parametrize("context", [0, 128, 2048])
def test_intensity_grows_with_batch_and_falls_with_context(context):
    xs = [decode_step(LLAMA2_7B, b, context).intensity for b in (1, 2, 4, 8, 16, 64, 256, 1024)]
    assert xs == sorted(xs) and len(set(xs)) == len(xs)
    assert decode_step(LLAMA2_7B, 16, context + 64).intensity < decode_step(LLAMA2_7B, 16, context).intensity
    # the limit: per-sequence FLOPs over per-sequence KV bytes, approached from below
    one = decode_step(LLAMA2_7B, 1, context)
    assert decode_step(LLAMA2_7B, 10**6, context).intensity < one.flops / one.kv_bytes


def test_prefill_is_far_more_intense_than_decode():
    assert prefill_step(LLAMA2_7B, 512).intensity > 100 * decode_step(LLAMA2_7B, 1, 512).intensity
    assert prefill_step(LLAMA2_7B, 512).bound_on(A100) == "compute-bound"
    assert decode_step(LLAMA2_7B, 1, 512).bound_on(A100) == "bandwidth-bound"


def _brute(shape, device, context, limit=5000):
    return next((b for b in range(1, limit) if decode_step(shape, b, context).intensity >= device.ridge), None)


@pytest.mark.parametrize("device", [T4, A100, H100, Device("toy", 1e9, 1e9)])
@pytest.mark.parametrize("context", [0, 16, 128, 512])
def test_ridge_batch_is_the_first_compute_bound_batch(device, context):
    got = ridge_batch(LLAMA2_7B, device, context)
    assert got == _brute(LLAMA2_7B, device, context)
    if got is not None:
        assert decode_step(LLAMA2_7B, got, context).bound_on(device) == "compute-bound"
        assert got == 1 or decode_step(LLAMA2_7B, got - 1, context).bound_on(device) == "bandwidth-bound"


def test_ridge_batch_none_when_kv_reads_keep_decode_below_the_ridge():
    assert ridge_batch(LLAMA2_7B, A100, 512) is None  # the limit f/k is below A100's ridge
    one = decode_step(LLAMA2_7B, 1, 512)
    assert one.flops / one.kv_bytes < A100.ridge
    # 2 bytes per weight: about B FLOPs per byte, so the ridge batch is near the ridge point itself
    assert math.isclose(ridge_batch(LLAMA2_7B, A100, 0), A100.ridge, rel_tol=0.02)


def test_published_ridges():
    assert A100.ridge == pytest.approx(312e12 / 2039e9) and H100.ridge > A100.ridge > 100


def test_kv_capacity_by_hand():
    dev = Device("toy", 1e12, 1e9, memory_bytes=TINY.total_params * 2 + 10 * 6 * 32 + 31)
    assert kv_capacity_batch(TINY, dev, context=5) == 10  # 10 sequences of 6 tokens, 31 bytes to spare
    assert kv_capacity_batch(LLAMA2_7B, A100, 2048) < kv_capacity_batch(LLAMA2_7B, A100, 512)
    with pytest.raises(ValueError):
        kv_capacity_batch(TINY, Device("no size", 1, 1), 5)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError):
        decode_step(TINY, bad, 0)
    with pytest.raises(ValueError):
        prefill_step(TINY, bad)


def test_shape_from_a_loaded_model():
    from conftest import tiny_model
    model = tiny_model("llama")
    shape = ModelShape.from_model(model)
    cfg = model.config
    assert shape.num_layers == cfg.num_hidden_layers and shape.bytes_per_param == 4
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert shape.total_params == sum(p.numel() for p in model.parameters()) - norms


def test_measurements_are_positive_numbers():
    dev = measure_device("cpu", n=64, nbytes=1 << 20, repeats=2)
    assert dev.peak_flops > 0 and dev.bandwidth > 0 and dev.ridge > 0


def test_claim_line_format(capsys):
    assert claim("two is more than one", 2 > 1) is None  # a cell ending in a claim shows only its line
    claim("one is more than two", torch.tensor(1 > 2))
    out = capsys.readouterr().out
    assert out == ("claim: two is more than one -- holds\n"
                   "claim: one is more than two -- DID NOT HOLD on this machine\n")
    assert failed_claims("noise\n" + out) == ["one is more than two"]
    for bad in ("", "two\nlines", None):
        with pytest.raises(ValueError):
            claim(bad, True)
    with pytest.raises(ValueError):
        claim("a tensor of many values", torch.tensor([True, False]))


def test_timeit_takes_the_median():
    calls = []
    assert timeit(lambda: calls.append(1), repeats=5, warmup=2) >= 0 and len(calls) == 7
    with pytest.raises(ValueError):
        timeit(lambda: None, repeats=0)


def test_roofline_figure_has_title_and_labelled_axes():
    from cbteach.viz.roofline import plot_roofline
    bierce_like = ModelShape("small", 4, 192, 6, 2, 512, 2048, bytes_per_param=4)
    here = Device("here", 4e10, 1.6e10)
    ax = plot_roofline([here, T4, A100, H100], [(bierce_like, here), (LLAMA2_7B, A100)])
    assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
    assert len(ax.get_legend().get_texts()) == 4 + 2 * 2
    with pytest.raises(ValueError):
        plot_roofline([], [(LLAMA2_7B, A100)])
    import matplotlib.pyplot as plt
    plt.close("all")


def test_stored_failed_claims_reads_a_notebooks_outputs(tmp_path):
    """What ``tools/store_outputs.py`` and the notebook tests run on stored outputs: stream lines (as a
    list or a string) and plain-text results are read; markdown cells are not outputs."""
    import json

    from cbteach.perf.claims import stored_failed_claims
    failed = "claim: b -- DID NOT HOLD on this machine\n"
    cells = [{"cell_type": "markdown", "source": failed},
             {"cell_type": "code", "outputs": [{"output_type": "stream", "text": ["claim: a -- holds\n", failed]}]},
             {"cell_type": "code", "outputs": [{"output_type": "execute_result",
                                                "data": {"text/plain": "claim: c -- DID NOT HOLD on this machine"}}]}]
    path = tmp_path / "n.ipynb"
    path.write_text(json.dumps({"cells": cells}))
    assert stored_failed_claims(path) == [(1, "b"), (2, "c")]
