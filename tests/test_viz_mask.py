"""The mask visualiser's three layouts: the same rule, keys in each cache's order; paged as the kernel sees it."""
import re

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402

from cbteach import Engine, Request  # noqa: E402
from cbteach.attention.metadata import build  # noqa: E402
from cbteach.kv.paged import PagedKVPool  # noqa: E402
from cbteach.attention.packing import block_diagonal_causal_mask, per_sequence_causal_mask  # noqa: E402
from cbteach.attention.reference import reference_attention  # noqa: E402
from cbteach.viz import draw_step, mask_ascii, mask_heatmap  # noqa: E402
from cbteach.viz.mask import LAYOUTS, key_groups, paged_mask, resolve  # noqa: E402
from cbteach.viz.stepper import mask_explorer, parse_pairs  # noqa: E402
from cbteach.viz.style import STATE_COLORS, record_request_colors  # noqa: E402
from conftest import tiny_model  # noqa: E402

ROW = re.compile(r"^([A-Z]+ p\d+)\s+(.*)$")
STEPS = [([3, 0, 5], [1, 4, 1]), ([0, 3, 2], [4, 1, 1]), ([7], [1]), ([2, 9, 0], [1, 1, 6]), ([3, 5], [1, 1])]


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def grid(text):
    """The ``#``/``.``/``-`` rows back into a boolean matrix (``-``, an empty slot, is masked)."""
    rows = [[c == "#" for c in m.group(2) if c in "#.-"] for m in map(ROW.match, text.splitlines()) if m]
    return torch.tensor(rows, dtype=torch.bool)


def header(text, name):
    return next(ln for ln in text.splitlines() if ln.startswith(name))


@pytest.mark.parametrize("cached,new", STEPS)
def test_three_layouts_are_one_mask_with_keys_reordered(cached, new):
    concat, per_seq = block_diagonal_causal_mask(cached, new), per_sequence_causal_mask(cached, new)
    assert torch.equal(grid(mask_ascii(cached=cached, new=new, layout="concat")), concat)
    assert torch.equal(grid(mask_ascii(cached=cached, new=new, layout="per-sequence")), per_seq)
    # concat's columns put back in per-sequence order give the per-sequence mask
    runs = {(s, part): range(a, b) for s, part, a, b in key_groups(cached, new, "concat")}
    order = [k for s, part, *_ in key_groups(cached, new, "per-sequence") for k in runs[(s, part)]]
    assert torch.equal(concat[:, order], per_seq)
    # the paged layout is the per-sequence one plus empty slots, and those are masked
    view = resolve(cached=cached, new=new, layout="paged", block_size=2)
    assert torch.equal(grid(mask_ascii(cached=cached, new=new, layout="paged", block_size=2)), view.mask)
    filled = [k for k, key in enumerate(view.keys) if key.part != "empty"]
    assert torch.equal(view.mask[:, filled], per_seq)
    assert not view.mask[:, [k for k, key in enumerate(view.keys) if key.part == "empty"]].any()


@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 16])
@pytest.mark.parametrize("cached,new", [c for c in STEPS if min(c[1]) > 0])
def test_paged_mask_is_what_paged_attention_computes(cached, new, block_size):
    """Dense attention over the gathered slots with the drawn mask == the engine's paged reference."""
    torch.manual_seed(0)
    counts = [-(-(c + n) // block_size) for c, n in zip(cached, new)]
    perm = torch.randperm(sum(counts) + 2).tolist()  # scattered blocks, not in order
    tables = [perm[sum(counts[:s]):sum(counts[:s + 1])] for s in range(len(counts))]
    pool = PagedKVPool(num_layers=1, num_blocks=sum(counts) + 2, block_size=block_size, num_kv_heads=2, head_dim=8)
    pool.k[0].normal_()
    pool.v[0].normal_()
    meta = build([0] * sum(new), cached, new, "cpu", block_tables=tables, block_size=block_size)
    meta.pool = pool
    query = torch.randn(1, 2, sum(new), 8)
    want = reference_attention(query, 0, meta)

    mask, keys = paged_mask(cached, new, block_size, tables)
    slots = torch.tensor([(0 if key.block is None else key.block) * block_size + key.offset for key in keys])
    k, v = pool.read_slots(0, slots)
    got = F.scaled_dot_product_attention(query, k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask)
    assert torch.allclose(got, want, atol=1e-5)


def test_paged_header_names_blocks_and_padding():
    text = mask_ascii(cached=[3, 0, 5], new=[1, 4, 1], layout="paged", block_tables=[[7], [2], [11, 3]])
    assert "block_size 4" in text and "6 queries x 16 slots (14 keys, 2 empty)" in text
    assert header(text, "blk").split()[1:] == ["7", "2", "11", ":3"]
    assert header(text, "pos").split()[1:] == ["0123", "0123", "0123:45--"]
    assert text.splitlines()[-1].endswith("####:##--")  # C's query: its own empty slots shown as '-'
    # A (4 tokens, 2 blocks of 2) is read padded to C's 3 blocks: the padded block is masked
    text = mask_ascii(cached=[3, 5], new=[1, 1], layout="paged", block_size=2)
    assert header(text, "blk").split()[1:4] == ["0", ":1", ":-"]
    assert header(text, "A p3").split()[2] == "##:##:--"
    # long block ids go one digit per line
    text = mask_ascii(cached=[1], new=[1], layout="paged", block_size=1, block_tables=[[12, 345]])
    assert [ln.split()[-1] for ln in text.splitlines() if ln.startswith(("  ", "blk"))][-3:] == [":3", "1:4", "2:5"]


def test_default_block_tables_and_empty_steps():
    view = resolve(cached=[3, 0, 5], new=[1, 4, 1], layout="paged")
    assert view.block_size == 4 and sorted({key.block for key in view.keys}) == [0, 1, 2, 3]
    assert mask_ascii(cached=[], new=[], layout="paged") == "(empty step: no queries)"
    assert mask_ascii(cached=[5], new=[0], layout="paged", block_size=3).endswith("5 cached keys, nothing attends them")


@pytest.mark.parametrize("kwargs,match", [
    ({"layout": "ragged"}, "concat', 'per-sequence', 'paged"),
    ({"layout": "paged", "block_size": 0}, "block_size must be an integer >= 1"),
    ({"layout": "paged", "block_tables": [[0], [1]]}, "block_tables has 2 entries for 3 sequences"),
    ({"layout": "paged", "block_tables": [[0], [1], [2]]}, "C has 6 tokens: its block table needs at least 2"),
    ({"layout": "paged", "block_tables": [[0], [1], [2, -1]]}, ">= 0"),
    ({"layout": "concat", "block_size": 4}, "only to layout='paged'"),
    ({"layout": "per-sequence", "block_tables": [[0], [1], [2, 3]]}, "only to layout='paged'"),
])
def test_bad_arguments_say_what_is_allowed(kwargs, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        mask_ascii(cached=[3, 0, 5], new=[1, 4, 1], **kwargs)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_heatmap_each_layout(layout):
    kwargs = {"block_size": 2} if layout == "paged" else {}
    ax = mask_heatmap(cached=[3, 0, 5], new=[1, 4, 1], layout=layout, **kwargs)
    view = resolve(cached=[3, 0, 5], new=[1, 4, 1], layout=layout, **kwargs)
    shade = torch.as_tensor(ax.images[0].get_array())
    assert torch.equal((shade == 1) | (shade == 2), view.mask)
    cached_cols = torch.tensor([key.part == "cached" for key in view.keys])
    assert set(shade[:, cached_cols].unique().tolist()) <= {0, 1}
    assert (shade == 3).any() == (layout == "paged")  # grey: empty paged slots of a query's own sequence
    assert f"{layout} layout" in ax.get_title() and ax.get_xlabel().startswith("key") and ax.get_ylabel()
    assert len(ax.get_legend().get_texts()) == (4 if layout == "paged" else 3)


def paged_run():
    eng = Engine(tiny_model("llama"), max_batch_size=3, kv="paged", block_size=4, num_blocks=40)
    eng.run([Request([7, 8, 9], 6, request_id="r0"), Request([10] * 9, 3, request_id="r1"),
             Request([11, 12], 8, request_id="r2"), Request([13, 14, 15, 16], 4, request_id="r3")])
    return eng.records


def test_paged_records_draw_through_their_block_tables():
    records = paged_run()
    drawn = refused = 0
    for rec in records:
        assert torch.equal(grid(mask_ascii(rec)), rec.mask())  # default: per-sequence, as rec.mask()
        if rec.finished:  # a finished sequence freed its blocks before the record was taken
            with pytest.raises(ValueError, match="per-sequence"):
                mask_ascii(rec, layout="paged")
            refused += 1
            continue
        view = resolve(rec, layout="paged")
        assert torch.equal(view.mask[:, [k for k, key in enumerate(view.keys) if key.part != "empty"]], rec.mask())
        assert {key.block for key in view.keys} - {None} <= {b for t in rec.kv_usage["block_tables"].values() for b in t}
        drawn += 1
    assert drawn and refused


def test_concat_record_refuses_other_layouts():
    eng = Engine(tiny_model("llama"), max_batch_size=2)
    eng.run([Request([7, 8, 9], 2, request_id="r0")])
    for layout in ("per-sequence", "paged"):
        with pytest.raises(ValueError, match="'concat' step"):
            mask_ascii(eng.records[0], layout=layout)


def test_draw_step_colours_decodes_blue_and_prefills_orange():
    records = paged_run()
    colors = record_request_colors(records)
    i = next(i for i, r in enumerate(records) if r.is_fused)
    fig = draw_step(records, i)
    row = next(ax for ax in fig.axes if ax.get_gid() == "packed_row")
    tokens = [p for p in row.patches if p.get_gid() == "token"]
    kinds = [s.kind for s in records[i].seqs for _ in range(s.num_scheduled_tokens)]
    assert {"prefill", "decode"} <= set(kinds)
    for patch, kind in zip(tokens, kinds):
        assert patch.get_facecolor() == to_rgba(STATE_COLORS[kind])
    bands = [p.get_facecolor() for p in row.patches if p.get_gid() == "request"]
    assert bands == [to_rgba(colors[s.request_id]) for s in records[i].seqs]
    slots = next(ax for ax in fig.axes if ax.get_gid() == "slots")
    bars = {to_rgba(p.get_facecolor()) for p in slots.patches if p.get_gid() != "request"}
    assert to_rgba(STATE_COLORS["decode"]) in bars and to_rgba(STATE_COLORS["prefill"]) in bars


def test_parse_pairs():
    assert parse_pairs("3:1, 0:4,5:1") == ([3, 0, 5], [1, 4, 1])
    assert parse_pairs(" ") == ([], [])
    for bad in ("3-1", "3:1:2", "a:1", "3:-1"):
        with pytest.raises(ValueError, match="cached:new|>= 0"):
            parse_pairs(bad)


def test_mask_explorer_redraws_and_reports_mistakes():
    w = mask_explorer("2:1, 0:3")
    assert w.layout_menu.options == LAYOUTS and w.layout_menu.value == "per-sequence"
    assert "4 queries" in w.render().axes[0].get_title()
    w.layout_menu.value = "paged"
    w.block_size_box.value = 2
    title = w.render().axes[0].get_title()
    assert "paged layout, block_size 2" in title and "4 queries x" not in title
    w.lengths.value = "2:1, oops"  # redraw prints a ✗ instead of raising
    with pytest.raises(ValueError, match="cached:new"):
        w.render()
