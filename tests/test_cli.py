"""The command line: the demo tells the whole story and confirms identical tokens; mask; bench; the
course written out (notebooks, student) without overwriting anyone's work; serve and bench-serve wired
to their modules; help, --version and one-line errors."""
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import cbteach
from cbteach.__main__ import COMMANDS, main


def test_demo_runs_offline_and_confirms_identical_tokens():
    out = subprocess.run([sys.executable, "-m", "cbteach", "demo", "--repeat", "2"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for expected in ("1 CPU thread(s)", "warming up", "Static batching", "batch barrier", "Continuous batching",
                     "admit", "finish", "Packed row of step 0", "fused with decodes", "tokens/s", "run 2:",
                     "(median of 2)", "identical tokens from static and continuous batching: YES"):
        assert expected in text, expected
    assert "|" in text and "#" in text  # the ASCII masks
    # admissions and finishes are told in step order, as they happen
    steps = [int(ln.split()[1].rstrip(":")) for ln in text.splitlines() if ln.startswith("step ") and
             ("admit" in ln or "finish" in ln)]
    assert steps == sorted(steps) and len(steps) == 12  # six admissions, six finishes


def test_help_lists_every_command_and_version(capsys):
    assert main([]) == 0
    text = capsys.readouterr().out
    for name, what in COMMANDS.items():
        assert f"  {name:12s} {what}" in text
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"cbteach {cbteach.__version__}"
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2 and "unknown command 'frobnicate'" in capsys.readouterr().err


def test_help_and_mask(capsys):
    assert main(["mask", "--cached", "1,0", "--new", "1,2"]) == 0
    assert "#" in capsys.readouterr().out


def test_the_mask_cli_does_not_import_the_command_line():
    """No cycle: cbteach.viz.mask_cli never imports cbteach.__main__."""
    code = "import sys, cbteach.viz.mask_cli as m; m.cli(['--cached', '1', '--new', '1']); print('__main__' in " \
           "' '.join(k for k in sys.modules if k.startswith('cbteach')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("False")


@pytest.mark.parametrize("command, module", [("serve", "cbteach.serving.server"),
                                             ("bench-serve", "cbteach.bench.endpoint")])
def test_serve_commands_call_their_module(command, module, monkeypatch):
    seen = []
    monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(main=lambda argv: seen.append(argv) or 0))
    for name in ("fastapi", "uvicorn"):  # present or not, the wiring is what is tested here
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    assert main([command, "--port", "0"]) == 0
    assert seen == [["--port", "0"]]


@pytest.mark.parametrize("command, missing", [("serve", "cbteach.serving.server"), ("bench-serve", "fastapi"),
                                              ("serve", "uvicorn")])
def test_serve_commands_without_their_extra_say_what_to_install(command, missing, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, missing, None)  # `import missing` now raises ImportError
    assert main([command]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'cbteach[serve]'" in err and "Traceback" not in err


def test_demo_bad_device_is_one_line_in_the_options_words(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--device", "banana"])
    err = capsys.readouterr().err
    assert "unknown device 'banana'; use --device cpu, cuda, mps, or auto" in err and "None" not in err


def test_bench_help_is_plain_text_with_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    assert "``" not in text and "**" not in text and ":mod:" not in text
    assert "requests in the workload (default: 32)" in text and "(default: None)" not in text


def test_an_uncached_hub_model_fails_at_once_when_the_hub_is_unreachable(monkeypatch):
    """Offline without HF_HUB_OFFLINE: no minute of retries, the same clear error (only 127.0.0.1 is tried)."""
    from cbteach.models import hub_reachable, load_model

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    assert hub_reachable(timeout=2) is False
    with pytest.raises(ValueError, match="load_model\\('bierce'\\)"):
        load_model("some-org/not-here")


def test_notebooks_writes_the_course_and_keeps_existing_work(tmp_path, capsys):
    dst = tmp_path / "course"
    assert main(["notebooks", str(dst)]) == 0
    names = sorted(p.name for p in dst.glob("*.ipynb"))
    assert names and names[0].startswith("00_") and (dst / "INSTRUCTOR.md").exists()
    assert f"wrote {len(names)} notebooks to {dst}" in capsys.readouterr().out
    mine = dst / names[0]
    mine.write_text("my work")
    assert main(["notebooks", str(dst)]) == 2  # refused: nothing overwritten
    assert "add --force to overwrite" in capsys.readouterr().err and mine.read_text() == "my work"
    assert main(["notebooks", str(dst), "--force"]) == 0 and mine.read_text() != "my work"
    stu = tmp_path / "student"
    assert main(["notebooks", str(stu), "--student"]) == 0
    assert not (stu / "INSTRUCTOR.md").exists()
    cells = [c for n in names for c in json.loads((stu / n).read_text())["cells"]
             if "solution" in c.get("metadata", {}).get("tags", [])]
    assert cells and all("".join(c["source"]).startswith("# Your solution here") for c in cells)


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
    (["--layout", "paged", "--block-tables", "5;5;5,6"], "block 5 appears twice in the block tables"),
    (["--layout", "paged", "--block-size", "1000000000"], "a mask to read in a terminal has at most"),
    (["--layout", "paged", "--block-tables", "0,1;2,3;4,99999999999999999999"], "block ids must be at most"),
    (["--layout", "paged", "--block-tables", "0,1;2,3;4,-5"], "-5 is negative; block ids must be >= 0"),
])
def test_mask_bad_arguments_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["mask", "--cached", "3,0,5", "--new", "1,4,1", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_mask_too_large_to_read_is_refused_before_it_is_built(capsys):
    """100,000 new tokens would be a 10^10-cell mask: refused by its size, not by the machine's memory."""
    with pytest.raises(SystemExit) as exc:
        main(["mask", "--cached", "0", "--new", "100000"])
    assert exc.value.code == 2 and "100000 queries" in capsys.readouterr().err


def test_mask_png_says_where_the_file_went(tmp_path, capsys):
    assert main(["mask", "--cached", "1", "--new", "1", "--png", str(tmp_path / "noext")]) == 0
    assert f"heatmap saved to {tmp_path / 'noext.png'}" in capsys.readouterr().out
    assert (tmp_path / "noext.png").read_bytes()[:4] == b"\x89PNG"


def test_mask_png_naming_a_folder_is_refused(tmp_path, capsys):
    """A folder was taken as a name: "heatmap saved to FOLDER.png", beside it."""
    with pytest.raises(SystemExit) as exc:
        main(["mask", "--cached", "1", "--new", "1", "--png", str(tmp_path)])
    assert exc.value.code == 2 and "is a folder" in capsys.readouterr().err
    assert not tmp_path.with_suffix(".png").exists()
    for empty in ("", " "):  # saved nothing and said nothing
        with pytest.raises(SystemExit) as exc:
            main(["mask", "--cached", "1", "--new", "1", "--png", empty])
        assert exc.value.code == 2 and "--png needs a file name" in capsys.readouterr().err


def test_course_files_beside_the_notebooks_are_kept_too_and_a_copy_onto_itself_is_refused(tmp_path, capsys):
    dst = tmp_path / "course"
    dst.mkdir()
    (dst / "INSTRUCTOR.md").write_text("my notes")
    assert main(["notebooks", str(dst)]) == 2
    assert "INSTRUCTOR.md" in capsys.readouterr().err and (dst / "INSTRUCTOR.md").read_text() == "my notes"
    assert main(["notebooks", str(tmp_path / "src")]) == 0
    capsys.readouterr()
    assert main(["student", str(tmp_path / "src"), str(tmp_path / "src"), "--force"]) == 2
    assert "the folder the notebooks come from" in capsys.readouterr().err
    first = sorted((tmp_path / "src").glob("*.ipynb"))[0]
    assert "solution" in first.read_text()  # the originals are untouched


@pytest.mark.parametrize("argv, message", [
    (["demo", "--batch-size", "7"], "at most 6 slots"),
    (["bench", "--workload", "length_variance", "--sweep", "inf"], "finite numbers"),
    (["bench", "--workload", "length_variance", "--sweep", "nan,2"], "finite numbers"),
    (["bench", "--workload", "length_variance", "--sweep", "1.5"], "whole numbers of tokens"),
    (["simulate", "run", "--requests", "0"], "argument --requests: '0' is not an integer > 0"),
    (["simulate", "capacity", "--users", "0"], "argument --users: '0' is not an integer > 0"),
    (["simulate", "capacity", "--price=-1"], "argument --price: '-1' is not a number > 0"),
    (["simulate", "capacity", "--ttft=-1"], "argument --ttft: '-1' is not a number > 0"),
    (["simulate", "capacity", "--tpot", "nan"], "argument --tpot: 'nan' is not a number > 0"),
    (["bench", "--rate", "inf"], "argument --rate: 'inf' is not a number > 0"),
    (["bench", "--threads", "100000"], "threads is more than 4 per core"),  # (a crash in torch's thread pools)
    (["simulate", "calibrate", "--threads", "100000"], "threads is more than 4 per core"),
    (["notebooks", ""], "give the folder to write the notebooks into"),  # (wrote 16 notebooks into the cwd)
    (["student", "notebooks", ""], "DST is empty: give a folder"),  # (the same, for the student copy)
    (["student", "", "x"], "SRC is empty: give a folder"),
    (["bench", "--json", "r.json", "--out", "results"], "give one, not both"),  # (--out was ignored)
    (["bench", "--engines", "static", "--device", "meta"], "unknown device 'meta'"),
    (["demo", "--device", "xpu"], "unknown device 'xpu'"),  # torch knows the name; the course runs on cpu/cuda/mps
    (["demo", "--device", "meta"], "unknown device 'meta'"),
    (["simulate"], "required: {validate,calibrate,run,capacity,static,devices,models}"),  # (was "required: what")
])
def test_more_bad_arguments_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["simulate", "calibrate", "--max-context", "16"], "max_context (16) is shorter than its longest prompt"),
    (["simulate", "run", "--rate", "1e-300"], "raise the rate"),  # (zero latencies: a step's ms lost at 1e301 s)
    # (a 100,000-token request to the 4,096-position model: "request 0: prompt (55461 tokens) ...", no option named)
    (["simulate", "calibrate", "--max-context", "100000"], "model's 4096 positions: give a smaller --max-context"),
    (["simulate", "calibrate", "--prompt", "4,4090", "--max-context", "4090"], "longest sequence would be 4138"),
    # (an --out that cannot be written was found after the measuring, and not named)
    (["simulate", "calibrate", "--out", "/"], "--out '/': cannot write the device file there: it is a folder"),
    (["simulate", "calibrate", "--out", ""], "--out '': cannot write the device file there: it names no file"),
    (["simulate", "capacity", "--rate-per-user", "5"], "--rate-per-user sizes the devices for --users"),
])
def test_simulate_refuses_a_workload_it_cannot_run_before_measuring(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_simulate_validate_names_a_data_file_it_cannot_use(tmp_path, capsys):
    """A run with a negative duration or a NaN step time gave negative errors and 'nan% less time'."""
    runs = json.loads((Path(cbteach.__file__).parent / "sim/data/bierce_cpu_runs.json").read_text())
    runs["runs"][0]["duration"] = -1
    impossible = json.dumps(runs)
    runs["runs"][0]["duration"], runs["runs"][1]["steps"][3]["t"] = 1.0, float("nan")
    for text in ("[1, 2]", "{}", "not json", impossible, json.dumps(runs)):
        bad = tmp_path / "runs.json"
        bad.write_text(text)
        assert main(["simulate", "validate", "--data", str(bad)]) == 2
        err = capsys.readouterr().err
        assert f"--data {bad}" in err and "Traceback" not in err


def test_tournament_checks_its_port_and_output_paths_before_it_runs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["tournament", str(tmp_path), "--port", "70000"])
    assert "0..65535" in capsys.readouterr().err
    assert main(["tournament", str(tmp_path), "--json", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--json {tmp_path}: it is a folder" in err


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
    # a second run would overwrite the learner's copy: refused without --force
    (tmp_path / "out" / "01_x.ipynb").write_text("learner's answers")
    assert main(["student", str(src), str(tmp_path / "out")]) == 2
    assert (tmp_path / "out" / "01_x.ipynb").read_text() == "learner's answers"
    assert main(["student", str(src), str(tmp_path / "out"), "--force"]) == 0


def test_a_student_copy_over_a_full_one_leaves_no_instructor_notes(tmp_path, capsys):
    """``notebooks DIR`` then ``notebooks DIR --student --force`` said the student copy was written, and DIR still
    held INSTRUCTOR.md and WORKSHOP_KIT.md; notes of the instructor's own (edited) are kept, with a warning."""
    assert main(["notebooks", str(tmp_path / "nb")]) == 0
    assert (tmp_path / "nb" / "INSTRUCTOR.md").exists()
    assert main(["notebooks", str(tmp_path / "nb"), "--student", "--force"]) == 0
    assert not (tmp_path / "nb" / "INSTRUCTOR.md").exists() and not (tmp_path / "nb" / "WORKSHOP_KIT.md").exists()
    assert main(["notebooks", str(tmp_path / "full")]) == 0
    (tmp_path / "full" / "INSTRUCTOR.md").write_text("my notes")
    capsys.readouterr()
    assert main(["student", str(tmp_path / "full"), str(tmp_path / "full2")]) == 0  # (a copy beside: none to remove)
    assert main(["student", str(tmp_path / "nb"), str(tmp_path / "full"), "--force"]) == 0
    assert (tmp_path / "full" / "INSTRUCTOR.md").read_text() == "my notes" and "it was kept" in capsys.readouterr().out


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
    (["--json", "/proc/x.json"], "cannot write the results to /proc/x.json"),  # (root may write anywhere but there)
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


def test_load_model_takes_cpu_cuda_mps_and_floating_point_dtypes_only():
    from cbteach import load_model

    for device in ("xpu", "meta", "lazy"):
        with pytest.raises(ValueError, match=f"unknown device '{device}'; use 'cpu', 'cuda', 'mps'"):
            load_model("bierce", device=device)
    for dtype in ("int8", "bool", 32, "float8_e4m3fn", "complex64"):
        with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16, float64"):
            load_model("bierce", dtype=dtype)
    assert next(load_model("bierce", dtype="float64")[0].parameters()).dtype == __import__("torch").float64


def test_bench_serve_refuses_an_endpoint_that_is_not_a_url(capsys):
    from cbteach.bench.endpoint import main as bench_serve

    for endpoint in ("notaurl", "ftp://x", ""):
        assert bench_serve(["--endpoint", endpoint]) == 2
        err = capsys.readouterr().err
        assert "--endpoint takes the server's http(s) URL" in err and "Traceback" not in err
    assert bench_serve(["--endpoint", "http://127.0.0.1:9", "--tokenizer", "no-org/no-such-tokenizer"]) == 2
    assert "the embedded one is --tokenizer bierce" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--num-blocks", "10", "--kv-memory-bytes", "100000"], "give --num-blocks or --kv-memory-bytes, not both"),
    (["--port", "-1"], "argument --port: must be in 0..65535"),
    (["--device", "xpu"], "unknown device 'xpu'; use --device cpu, cuda, mps, or auto"),
    (["--threads", "100000"], "threads is more than 4 per core"),
    (["--num-speculative-tokens", "3"], "no --speculative was given: add --speculative ngram"),
    (["--speculative", " "], "--speculative must not be empty"),  # (speculation was silently off)
    (["--stats-interval", "1"], "at --log-level warning none is: add --log-level info"),
    (["--data-parallel-size", "100000"], "model processes, more than 4 per core"),  # (a traceback: too many files)
])
def test_serve_refuses_bad_options_before_anything_starts(argv, message, capsys):
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    from cbteach.serving.server import main as serve

    with pytest.raises(SystemExit) as e:
        serve(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err, err


def test_demo_refuses_a_max_new_tokens_past_the_models_positions_before_it_runs_anything(capsys):
    """It warmed up and began the static story, then failed there."""
    assert main(["demo", "--max-new-tokens", "100000", "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert "exceeds the model's 4096 positions" in err and "warming up" not in out and "Static" not in out


def test_demo_and_student_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--batch-size", "0"])
    assert "'0' is not an integer >= 1" in capsys.readouterr().err
    assert main(["demo", "--model", "some-org/not-here"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m cbteach demo: error:") and "--model bierce" in err and "Traceback" not in err
    assert main(["demo", "--model", str(tmp_path / "no-such-folder")]) == 2
    assert "no such folder" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["student", "notebooks", str(blocker / "out")]) == 2
    assert capsys.readouterr().err.startswith("python -m cbteach student: error:")
    # A notebook that is not one: a traceback ({"cells": 5}), or a JSON error naming no file and an empty DST left.
    for i, text in enumerate(('{"cells": 5}', "not json")):
        src = tmp_path / f"src{i}"
        src.mkdir()
        (src / "00_x.ipynb").write_text(text)
        assert main(["student", str(src), str(tmp_path / f"out{i}")]) == 2
        err = capsys.readouterr().err
        assert "00_x.ipynb is not a notebook" in err and "Traceback" not in err, err
        assert not (tmp_path / f"out{i}").exists()


def test_bierce_corpus_and_train_write_nowhere_by_default_and_say_what_is_missing(tmp_path, capsys, monkeypatch):
    import gzip

    from cbteach.bierce import corpus, train

    monkeypatch.chdir(tmp_path)
    assert corpus.main(["--dictd", str(tmp_path / "missing.dz")]) == 2
    assert "apt-get install dict-devil" in capsys.readouterr().err
    (tmp_path / "bad.dz").write_bytes(b"not gzip")
    assert corpus.main(["--dictd", str(tmp_path / "bad.dz")]) == 2
    assert "not a gzip'd dictd file" in capsys.readouterr().err
    text = "header\nABASEMENT, n.  The act of abasing.\n\nCYNIC, n.  A blackguard.\n"
    (tmp_path / "devil.dict.dz").write_bytes(gzip.compress(text.encode("latin-1")))
    assert corpus.main(["--dictd", str(tmp_path / "devil.dict.dz")]) == 0  # default: ./corpus.jsonl
    lines = (tmp_path / "corpus.jsonl").read_text().splitlines()
    assert [json.loads(x)["headword"] for x in lines] == ["ABASEMENT", "CYNIC"]
    for argv, message in ((["--corpus", str(tmp_path / "nope.jsonl")], "python -m cbteach.bierce.corpus"),
                          (["--steps", "0"], "'0' is not a number > 0"),
                          (["--draft", "--tokenizer", str(tmp_path)], "no tokenizer.json")):
        with pytest.raises(SystemExit) as e:
            train.main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "bierce").exists()
