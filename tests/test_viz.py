"""The visualisers draw what the engine really did: masks from cbteach.attention.packing, slots from records."""
import re

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from cbteach import Engine, Request, static_batching  # noqa: E402
from cbteach.attention.packing import block_diagonal_causal_mask, per_sequence_causal_mask  # noqa: E402
from cbteach.core.records import SeqStep, StepRecord  # noqa: E402
from conftest import tiny_model  # noqa: E402
from cbteach.viz import (cli, draw_pool, draw_pool_step, draw_step, mask_ascii, mask_heatmap, plot_timeline,  # noqa: E402
                         plot_timelines, pool_slider, seq_letter, slot_states_continuous, slot_states_static,
                         step_through, stored_tokens, waste_breakdown, wasted_fraction)

ROW = re.compile(r"^([A-Z]+ p\d+)\s+(.*)$")


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def parse_ascii(text):
    """Rows of ``#``/``.`` back into a boolean matrix, plus the row labels."""
    labels, rows = [], []
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            labels.append(m.group(1))
            rows.append([c == "#" for c in m.group(2) if c in "#."])
    return labels, torch.tensor(rows, dtype=torch.bool) if rows else None


def _requests():
    return [Request([7, 8, 9], 5, request_id="r0"), Request([10] * 12, 2, request_id="r1"),
            Request([11, 12], 9, request_id="r2"), Request([13, 14, 15, 16], 3, request_id="r3")]


@pytest.fixture(scope="module")
def run():
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=5)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    eng = Engine(model, max_batch_size=2)
    eng.run(_requests())
    paged = Engine(model, max_batch_size=2, kv="paged", block_size=4, num_blocks=32)
    paged.run(_requests())
    return {"records": eng.records, "static": static_batching(model, None, _requests(), 2),
            "paged": paged.records}


# -- mask: text ----------------------------------------------------------------------------------
@pytest.mark.parametrize("layout,make", [("concat", block_diagonal_causal_mask),
                                         ("per-sequence", per_sequence_causal_mask)])
def test_ascii_mask_is_the_packing_mask(layout, make):
    text = mask_ascii(cached=[3, 0, 5], new=[1, 4, 1], layout=layout)
    labels, drawn = parse_ascii(text)
    assert torch.equal(drawn, make([3, 0, 5], [1, 4, 1]))
    assert labels == ["A p3", "B p0", "B p1", "B p2", "B p3", "C p5"]
    assert "|" in text and "6 queries x 14 keys" in text


def test_ascii_mask_layouts_differ_in_key_order():
    header = [ln for ln in mask_ascii(cached=[3, 0, 5], new=[1, 4, 1]).splitlines() if ln.startswith("seq")][0]
    assert header.split()[1:] == ["AAA", "CCCCC", "|", "A", "BBBB", "C"]
    paged = [ln for ln in mask_ascii(cached=[3, 0, 5], new=[1, 4, 1], layout="per-sequence").splitlines()
             if ln.startswith("seq")][0]
    assert paged.split()[1:] == ["AAA|A", "|BBBB", "CCCCC|C"]


def test_ascii_mask_empty_and_single():
    assert mask_ascii(cached=[], new=[]) == "(empty step: no queries)"
    assert mask_ascii(cached=[4], new=[0]).startswith("(empty step: no queries)")
    labels, drawn = parse_ascii(mask_ascii(cached=[2], new=[3]))
    assert labels == ["A p2", "A p3", "A p4"]
    assert torch.equal(drawn, block_diagonal_causal_mask([2], [3]))


def test_ascii_mask_many_sequences_get_two_letters():
    assert [seq_letter(i) for i in (0, 25, 26, 27, 701, 702)] == ["A", "Z", "AA", "AB", "ZZ", "AAA"]
    cached, new = [1] * 28, [1] * 28
    labels, drawn = parse_ascii(mask_ascii(cached=cached, new=new))
    assert labels[-1] == "AB p1"
    assert torch.equal(drawn, block_diagonal_causal_mask(cached, new))


def test_ascii_mask_of_real_records(run):
    for rec in run["records"] + run["paged"]:
        _, drawn = parse_ascii(mask_ascii(rec))
        assert torch.equal(drawn, rec.mask()), rec


@pytest.mark.parametrize("kwargs,match", [
    ({"cached": [1, 2], "new": [1]}, "2 entries"),
    ({"cached": [-1], "new": [1]}, ">= 0"),
    ({"cached": [1.5], "new": [1]}, "integers"),
    ({"cached": [1], "new": [1], "layout": "ragged"}, "layout"),
    ({}, "cached= and new="),
])
def test_mask_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mask_ascii(**kwargs)


def test_mask_record_with_lists_or_wrong_layout(run):
    rec = run["records"][0]
    with pytest.raises(ValueError, match="not both"):
        mask_ascii(rec, cached=[1], new=[1])
    with pytest.raises(ValueError, match="concat"):
        mask_heatmap(rec, layout="paged")


# -- mask: heatmap -------------------------------------------------------------------------------
def test_heatmap_shows_the_mask():
    ax = mask_heatmap(cached=[3, 0, 5], new=[1, 4, 1])
    assert "6 queries" in ax.get_title() and "14 keys" in ax.get_title()
    assert ax.get_xlabel().startswith("key") and ax.get_ylabel().startswith("query")
    shade = torch.as_tensor(ax.images[0].get_array())
    assert torch.equal(shade > 0, block_diagonal_causal_mask([3, 0, 5], [1, 4, 1]))
    assert set(shade[:, :8].unique().tolist()) <= {0, 1}  # the 8 cached keys use the "cached" shade
    assert set(shade[:, 8:].unique().tolist()) == {0, 2}
    assert ax.get_legend() is not None


def test_heatmap_empty_and_single():
    ax = mask_heatmap(cached=[], new=[])
    assert "0 queries" in ax.get_title() and ax.get_xlabel() and not ax.images
    ax = mask_heatmap(cached=[0], new=[3], layout="paged")
    assert "3 queries" in ax.get_title() and "3 keys" in ax.get_title()


# -- timelines -----------------------------------------------------------------------------------
def test_slot_states_agree_with_records(run):
    records, st = run["records"], run["static"]
    states = slot_states_continuous(records, 2)
    assert len(states) == len(records)
    for rec, row in zip(records, states):
        for s in rec.seqs:
            assert row[s.slot] == (s.kind, s.request_id)
    useful = sum(state in ("prefill", "decode") for row in states for state, _ in row)
    assert useful == sum(len(r.seqs) for r in records)

    sst = slot_states_static(st)
    assert [[x[0] for x in row] for row in sst] == [[s.state for s in step.slots] for step in st.steps]
    w = waste_breakdown(st)
    assert w["idle"] == st.waste()["idle"] and w["prefill"] == st.waste()["prefill"]
    assert w["slot_steps"] == len(st.steps) * 2
    # r0 (3 tokens) and r2 (2 tokens) were padded to 12 and 4: shares 9/12 and 2/4
    assert w["padding"] == pytest.approx(9 / 12 + 2 / 4)
    assert wasted_fraction(st) >= wasted_fraction(records, 2) > 0


def test_continuous_idle_and_empty_rules():
    def seq(rid, slot, kind="decode"):
        return SeqStep(rid, slot, kind, 3, 1, [1])
    records = [StepRecord(0, "concat", [seq("a", 0, "prefill"), seq("b", 1, "prefill")], admitted=["a", "b"]),
               StepRecord(1, "concat", [seq("a", 0)]),  # b holds slot 1 but was not scheduled: idle
               StepRecord(2, "concat", [seq("b", 1)], preempted=["a"], finished=["b"]),  # a preempted: empty
               StepRecord(3, "concat", [])]
    assert slot_states_continuous(records, 3) == [
        [("prefill", "a"), ("prefill", "b"), ("empty", None)],
        [("decode", "a"), ("idle", "b"), ("empty", None)],
        [("empty", None), ("decode", "b"), ("empty", None)],
        [("empty", None)] * 3]
    w = waste_breakdown(records, 3)
    assert (w["idle"], w["empty"], w["slot_steps"]) == (1, 7, 12)
    assert w["wasted_fraction"] == pytest.approx(8 / 12)
    with pytest.raises(ValueError, match="outside"):
        slot_states_continuous(records, 1)


def test_plot_timelines(run):
    st, records = run["static"], run["records"]
    fig = plot_timelines(st, records, 2)
    top, bottom = fig.axes[:2]
    assert f"{wasted_fraction(st):.0%}" in top.get_title()
    assert f"{wasted_fraction(records, 2):.0%}" in bottom.get_title()
    assert top.get_xlim() == bottom.get_xlim() == (0, max(len(st.steps), len(records)))
    for ax in (top, bottom):
        assert ax.get_xlabel() == "step" and ax.get_ylabel() == "slot"
    assert top.get_legend() is not None
    assert any(t.get_text() == "r2" for t in bottom.texts)  # request ids written in wide bars
    ax = plot_timeline(records, 2)
    assert ax.get_title().startswith("Continuous batching") and ax.get_legend() is not None


# -- stepper -------------------------------------------------------------------------------------
def _panel(fig, gid):
    return next(ax for ax in fig.axes if ax.get_gid() == gid)


@pytest.mark.parametrize("kind", ["records", "paged"])
def test_draw_step_every_index(run, kind):
    records = run[kind]
    fig = plt.figure()
    for i, rec in enumerate(records):
        draw_step(records, i, fig=fig)  # redraws into the same figure
        shade = torch.as_tensor(_panel(fig, "mask").images[0].get_array())
        assert torch.equal(shade > 0, rec.mask())
        tokens = [p for p in _panel(fig, "packed_row").patches if p.get_gid() == "token"]
        assert len(tokens) == rec.num_tokens
        title = fig._suptitle.get_text()
        assert title.startswith(f"Step {i} ") and f"{rec.num_tokens} tokens" in title
        assert ("fuses prefill" in title) == rec.is_fused
        assert _panel(fig, "slots").get_ylabel() == "slot"
    assert any(r.is_fused for r in records)


def test_draw_step_index_out_of_range(run):
    records = run["records"]
    for bad in (len(records), -1, "3"):
        with pytest.raises(ValueError, match=f"0..{len(records) - 1}"):
            draw_step(records, bad)


def test_step_views_say_what_they_were_given_instead_of_records():
    model = tiny_model("llama")
    reqs = [Request([7, 8], 3), Request([9], 2)]
    for wrong in (static_batching(model, None, reqs, 2), 42):
        for draw in (draw_step, draw_pool_step):
            with pytest.raises(ValueError, match="expected the engine's step records"):
                draw(wrong, 0)
    quiet = Engine(model, max_batch_size=2, kv="paged", keep_records=False)
    quiet.run([Request([7, 8], 3)])
    with pytest.raises(ValueError, match="keep_records=True"):
        draw_step(quiet.records, 0)
    plt.close("all")


def test_step_through_widget(run):
    records = run["records"]
    widget = step_through(records)
    assert widget.slider.max == len(records) - 1 and widget.slider.description == "step"
    play = widget.children[0].children[0]
    assert play.max == len(records) - 1
    widget.slider.value = 2  # redraws through draw_step; must not raise


# -- pool ----------------------------------------------------------------------------------------
def test_draw_pool_every_step(run):
    records = run["paged"]
    for i, rec in enumerate(records):
        usage, tokens = rec.kv_usage, stored_tokens(records, i)
        assert sum(tokens.values()) == usage["num_tokens"]
        ax = draw_pool(usage, tokens=tokens)
        blocks = [p for p in ax.patches if (p.get_gid() or "").startswith("block ")]
        assert len(blocks) == usage["num_blocks"]
        colored = [p for p in blocks if p.get_facecolor() != to_rgba("white")]
        assert len(colored) == usage["num_used_blocks"]
        filled = sum(round(p.get_width() / blocks[0].get_width() * usage["block_size"])
                     for p in ax.patches if p.get_gid() == "fill")
        assert filled == usage["num_tokens"]
        assert f"{usage['num_used_blocks']} used, {usage['num_free_blocks']} free" in ax.get_title()
        assert ax.get_xlabel() and ax.get_ylabel()
        plt.close(ax.figure)


def test_one_colour_per_request_across_pictures(run):
    records = run["paged"]
    i = next(i for i, r in enumerate(records) if [s.kind for s in r.seqs][:1] == ["decode"])
    rid = records[i].seqs[0].request_id
    token = next(p for p in _panel(draw_step(records, i), "packed_row").patches if p.get_gid() == "request")
    pool_ax = draw_pool_step(records, i).axes[0]
    block = records[i].kv_usage["block_tables"][rid][0]
    cell = next(p for p in pool_ax.patches if p.get_gid() == f"block {block}")
    fills = [p.get_facecolor() for p in pool_ax.patches if p.get_gid() == "fill"]
    assert token.get_facecolor() == cell.get_edgecolor() and token.get_facecolor() in fills
    assert pool_ax.figure._suptitle.get_text().startswith(f"After step {i}")


def test_pool_slider_and_bad_input(run):
    widget = pool_slider(run["paged"])
    assert widget.slider.max == len(run["paged"]) - 1 and widget.slider.description == "step"
    widget.slider.value = 1
    with pytest.raises(ValueError, match="0.."):
        draw_pool_step(run["paged"], len(run["paged"]))
    with pytest.raises(ValueError, match="paged"):
        pool_slider(run["records"])
    with pytest.raises(ValueError, match="usage"):
        draw_pool({"num_blocks": 4})


# -- command line --------------------------------------------------------------------------------
def test_cli_prints_mask(capsys):
    assert cli(["--cached", "3,0,5", "--new", "1,4,1"]) == 0
    labels, drawn = parse_ascii(capsys.readouterr().out)
    assert labels[-1] == "C p5" and torch.equal(drawn, block_diagonal_causal_mask([3, 0, 5], [1, 4, 1]))
    cli(["--cached", "", "--new", ""])
    assert "empty step" in capsys.readouterr().out


def test_cli_png(tmp_path, capsys):
    out = tmp_path / "mask.png"
    cli(["--cached", "3,0,5", "--new", "1,4,1", "--layout", "paged", "--png", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "paged layout" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--cached", "3,0", "--new", "1,4,1"], "2 entries"),
    (["--cached=-1,2", "--new", "1,1"], "negative"),
    (["--cached", "1,x", "--new", "1,1"], "not an integer"),
    (["--new", "1"], "required"),
])
def test_cli_bad_input(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
