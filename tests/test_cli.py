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


SMALL_BENCH = ["bench", "--requests", "2", "--max-new-tokens", "4", "--history", "0", "--engines", "static",
               "--no-progress"]


@pytest.mark.parametrize("argv, message", [
    (["--max-new-tokens", "0"], "'0' is not an integer > 0"),
    (["--token-budget", "-3"], "'-3' is not an integer > 0"),
    (["--threads", "0"], "'0' is not an integer > 0"),
    (["--history", "-1"], "'-1' is not an integer >= 0"),
    (["--cap", "0"], "'0' is not an integer > 0"),
    (["--rate", "0"], "'0' is not a number > 0"),
    (["--ttft-target", "-1"], "'-1' is not a number > 0"),
    (["--engines", ""], "--engines is empty"),
    (["--workload", "poisson", "--sweep=-1,2"], "--sweep values must be"),
    (["--device", "banana"], "unknown device 'banana'"),
    (["--model", "some-org/not-here"], "bierce"),
    (["--json", "/proc/1/nope/x.json"], "cannot write the results to /proc/1/nope/x.json"),
])
def test_bench_bad_arguments_are_argparse_errors_before_any_run(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([*SMALL_BENCH, "--json", str(tmp_path / "x.json"), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bench_refuses_a_folder_as_its_json_file(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([*SMALL_BENCH, "--json", str(tmp_path)])
    assert "it is a folder" in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
def test_an_absent_device_is_a_clear_error(capsys):
    from cbteach import load_model

    with pytest.raises(ValueError, match="device 'cuda' is not available on this machine"):
        load_model("bierce", device="cuda")
    with pytest.raises(SystemExit):
        main([*SMALL_BENCH, "--device", "cuda"])
    assert "not available on this machine" in capsys.readouterr().err


def test_demo_and_student_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--batch-size", "0"])
    assert "'0' is not an integer >= 1" in capsys.readouterr().err
    assert main(["demo", "--model", "some-org/not-here"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m cbteach demo: error:") and "bierce" in err and "Traceback" not in err
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["student", "notebooks", str(blocker / "out")]) == 2
    assert capsys.readouterr().err.startswith("python -m cbteach student: error:")
