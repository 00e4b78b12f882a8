"""``make lab`` opens the learners' copy with the engine's files visible; ``make lab-solutions`` the
course with its solutions (tools/lab_config.py, the Makefile). No server is started: the config file
is read by traitlets' own loader, as ``jupyter lab --config`` reads it, and the file browser's listing
is asked of jupyter_server's contents manager with those settings."""
import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("jupyter_server")


def lab_config(monkeypatch, copy=None):
    from traitlets.config.loader import PyFileConfigLoader

    if copy is None:
        monkeypatch.delenv("CBTEACH_LAB", raising=False)
    else:
        monkeypatch.setenv("CBTEACH_LAB", copy)
    return PyFileConfigLoader("lab_config.py", path=str(ROOT / "tools")).load_config()


def listing(config, path=""):
    from jupyter_server.services.contents.filemanager import FileContentsManager

    cm = FileContentsManager(root_dir=config.ServerApp.root_dir, hide_globs=config.ContentsManager.hide_globs)
    return {entry["name"] for entry in cm.get(path, content=True)["content"]}


def engine_files_the_notebooks_name():
    names = set()
    for nb in ("03", "05", "06", "06b", "12"):
        (path,) = (ROOT / "notebooks").glob(f"{nb}_*.ipynb")
        names |= set(re.findall(r"cbteach/[\w/]+\.py", path.read_text()))
    return sorted(names)


def test_the_default_opens_the_student_copy_with_cbteach_visible_and_the_solutions_hidden(monkeypatch):
    config = lab_config(monkeypatch)
    assert config.ServerApp.ip == "127.0.0.1" and Path(config.ServerApp.root_dir) == ROOT
    assert config.LabApp.default_url == "/lab/tree/student/00_setup_and_first_generation.ipynb"
    top = listing(config)
    assert "cbteach" in top and "notebooks" not in top and "tests" not in top
    assert {"engine", "kv", "attention"} <= listing(config, "cbteach") and "course" not in listing(config, "cbteach")
    named = engine_files_the_notebooks_name()
    assert len(named) >= 5  # the notebooks do send learners to the engine's files
    for path in named:  # no part of the path is hidden from the file browser
        assert not any(fnmatch.fnmatch(part, g) for part in Path(path).parts for g in config.ContentsManager.hide_globs), path
        assert (ROOT / path).exists(), path


def test_lab_solutions_opens_the_course_with_its_solutions(monkeypatch):
    config = lab_config(monkeypatch, "solutions")
    assert config.LabApp.default_url == "/lab/tree/notebooks/00_setup_and_first_generation.ipynb"
    assert (ROOT / "notebooks" / "00_setup_and_first_generation.ipynb").exists()
    top = listing(config)
    assert {"cbteach", "notebooks"} <= top and "tests" not in top
    assert "INSTRUCTOR.md" in listing(config, "notebooks")


def test_an_unknown_copy_stops_jupyter_with_the_allowed_names(monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        lab_config(monkeypatch, "teacher")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "CBTEACH_LAB='teacher'" in err and "'student'" in err and "'solutions'" in err


def test_the_student_copy_the_default_url_names_is_what_the_student_command_writes(tmp_path):
    out = subprocess.run([sys.executable, "-m", "cbteach", "student", str(ROOT / "notebooks"), str(tmp_path / "s")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "s" / "00_setup_and_first_generation.ipynb").exists()
    assert not (tmp_path / "s" / "INSTRUCTOR.md").exists()


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine (Windows: the commands are in "
                                                          "notebooks/WORKSHOP_KIT.md)")
def test_make_lab_builds_the_student_copy_when_missing_then_opens_it():
    lab = subprocess.run(["make", "-n", "lab"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    lines = lab.splitlines()
    build = [i for i, ln in enumerate(lines) if "-m cbteach student notebooks student" in ln]
    start = [i for i, ln in enumerate(lines) if "CBTEACH_LAB=student" in ln and "jupyter lab --config=tools/lab_config.py" in ln]
    assert build and start and build[0] < start[0]
    assert lines[build[0]].startswith("test -f student/00_setup_and_first_generation.ipynb ||")  # work is kept
    sol = subprocess.run(["make", "-n", "lab-solutions"], cwd=ROOT, capture_output=True, text=True, timeout=60).stdout
    assert "CBTEACH_LAB=solutions" in sol and "cbteach student" not in sol
