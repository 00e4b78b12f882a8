"""The command line: the demo tells the whole story and confirms identical tokens; mask; student."""
import json
import os
import subprocess
import sys

import pytest

from cbteach.__main__ import main


def test_demo_runs_offline_and_confirms_identical_tokens():
    out = subprocess.run([sys.executable, "-m", "cbteach", "demo"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for expected in ("Static batching", "batch barrier", "Continuous batching", "admit", "finish",
                     "Packed row of step 0", "fused with decodes", "tokens/s",
                     "identical tokens from static and continuous batching: YES"):
        assert expected in text, expected
    assert "|" in text and "#" in text  # the ASCII masks


def test_help_and_mask(capsys):
    assert main([]) == 0
    assert main(["mask", "--cached", "1,0", "--new", "1,2"]) == 0
    assert "#" in capsys.readouterr().out


@pytest.mark.parametrize("layout", ["concat", "per-sequence", "paged"])
def test_mask_layouts_and_png(layout, tmp_path, capsys):
    png = tmp_path / f"{layout}.png"
    assert main(["mask", "--cached", "3,0,5", "--new", "1,4,1", "--layout", layout, "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert f"({layout} layout" in out and f"heatmap saved to {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mask_paged_options(capsys):
    assert main(["mask", "--cached", "3,0,5", "--new", "1,4,1", "--layout", "paged", "--block-size", "2",
                 "--block-tables", "9,4;1,0;2,6,3"]) == 0
    out = capsys.readouterr().out
    assert "block_size 2" in out and "6 queries x 16 slots (14 keys, 2 empty)" in out
    blk = next(ln for ln in out.splitlines() if ln.startswith("blk")).split()[1:]
    assert blk == ["9", ":4", ":-", "1", ":0", "2", ":6", ":3"]  # A padded to C's 3 blocks (one group)


@pytest.mark.parametrize("argv,message", [
    (["--layout", "ragged"], "invalid choice: 'ragged' (choose from 'concat', 'per-sequence', 'paged')"),
    (["--layout", "paged", "--block-size", "0"], "'0' is not an integer >= 1"),
    (["--layout", "concat", "--block-size", "4"], "apply only to --layout paged"),
    (["--layout", "paged", "--block-tables", "0;1"], "block_tables has 2 entries for 3 sequences"),
    (["--layout", "paged", "--block-tables", "0;1;2"], "its block table needs at least 2 blocks of 4, got 1"),
    (["--layout", "paged", "--block-tables", "0;x;2,3"], "block tables look like 0,1;2;3,4"),
])
def test_mask_bad_arguments_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["mask", "--cached", "3,0,5", "--new", "1,4,1", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_student_copy(tmp_path):
    src = tmp_path / "nbs"
    src.mkdir()
    nb = {"cells": [{"cell_type": "code", "source": "x = 6 * 7  # 42", "metadata": {"tags": ["solution"]},
                     "outputs": [], "execution_count": 1},
                    {"cell_type": "code", "source": "check(x)", "metadata": {}, "outputs": [],
                     "execution_count": 2}], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (src / "01_x.ipynb").write_text(json.dumps(nb))
    assert main(["student", str(src), str(tmp_path / "out")]) == 0
    out = json.loads((tmp_path / "out" / "01_x.ipynb").read_text())
    assert "42" not in out["cells"][0]["source"] and out["cells"][1]["source"] == "check(x)"
    assert "x = ..." in out["cells"][0]["source"]  # the stub names what to write


def test_bench_runs_small_and_writes_json(tmp_path, capsys):
    args = ["bench", "--workload", "length_variance", "--cap", "6", "--requests", "4", "--batch-size", "2",
            "--engines", "static,cbteach_paged,transformers_cb", "--history", "6", "--out", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "same tokens as static" in out and out.count(" True\n") == 2  # cbteach_paged's and transformers_cb's
    data = json.loads((tmp_path / "bench-bierce.json").read_text())
    assert set(data["step_time_vs_history"]) == {"concat", "paged"}
    assert list(data["engines"]) == ["static", "cbteach_paged", "transformers_cb"]
    assert data["workload"]["name"] == "length_variance" and data["workload"]["params"]["cap"] == 6
    paged = data["engines"]["cbteach_paged"]
    assert 0 < paged["paged_utilisation"] <= 1 and 0 < paged["contiguous_utilisation"] <= 1
    assert paged["matched"] is True and paged["ttft_p99"] > 0 and paged["tpot_p50"] > 0
    # a rate sweep: one point per rate, every point with its engines
    args = ["bench", "--workload", "poisson", "--sweep", "20,40", "--requests", "3", "--max-new-tokens", "6",
            "--engines", "static,cbteach_paged", "--history", "0", "--json", str(tmp_path / "sweep.json")]
    assert main(args) == 0
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert [p["workload"]["params"]["rate"] for p in data["sweep"]] == [20.0, 40.0]
    assert all(set(p["engines"]) == {"static", "cbteach_paged"} for p in data["sweep"])
    assert data["engines"] == data["sweep"][-1]["engines"]
