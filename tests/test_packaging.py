"""Every way in agrees: pyproject, environment.yml, README, CITATION.cff, CHANGELOG and the notebooks'
Colab cells say the same thing, and the wheel carries the course.

The wheel test builds cbteach from a copy of the checkout (offline: no build isolation, no
dependencies fetched), installs it into a folder of its own and runs the command line from another
folder against that copy -- what a user of a plain ``pip install`` gets.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

import cbteach

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
TORCH_FLOOR = "2.6"  # transformers 5 disables torch below 2.6


def _requirement(reqs, name):
    found = [r for r in reqs if re.match(rf"{re.escape(name)}\b(?![-_.\w])", r)]
    assert found, f"{name} is not among {reqs}"
    return found[0]


def test_import_cbteach_is_quick_and_the_names_come_when_used():
    """``import cbteach`` loads no torch or transformers where no GPU can exist (the names are imported
    when first used), so ``cbteach serve`` sets its signal handlers before seconds of imports; every
    public name still resolves, and an unknown one is an AttributeError."""
    from cbteach.attention.triton_mode import no_gpu_possible

    code = ("import sys, cbteach; heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules); "
            "print(heavy); import cbteach.serving.server; print(sorted(m for m in ('torch', 'transformers') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    if no_gpu_possible() or importlib.util.find_spec("triton") is None:
        assert out.stdout.split("\n")[:2] == ["[]", "[]"], out.stdout
    for name in cbteach.__all__:
        assert getattr(cbteach, name).__name__ == name
    assert set(cbteach.__all__) <= set(dir(cbteach))
    with pytest.raises(AttributeError, match="no attribute 'Engin'"):
        cbteach.Engin  # noqa: B018


def test_version_and_licence_are_written_once():
    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "cbteach.__version__"}
    assert PROJECT["license"] == "MIT"  # an SPDX expression, not the deprecated table
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert PROJECT["keywords"] and any("Python :: 3.10" in c for c in PROJECT["classifiers"])
    assert PROJECT["urls"]["Source"] == cbteach.REPO_URL


def test_core_dependencies_run_the_demo_and_the_mask_cli():
    deps = PROJECT["dependencies"]
    for name in ("matplotlib", "tqdm", "psutil", "transformers", "safetensors", "tokenizers", "numpy"):
        _requirement(deps, name)
    assert _requirement(deps, "torch").split(";")[0].replace(" ", "") == f"torch>={TORCH_FLOOR}"
    extras = PROJECT["optional-dependencies"]
    assert not any(r.startswith("jupyterlab") for r in extras["colab"])  # never JupyterLab into Colab
    assert {_requirement(extras["serve"], n) for n in ("fastapi", "uvicorn")}
    for name in ("pytest", "nbval", "httpx", "openai", "ruff", "sphinx", "myst-nb"):
        _requirement(extras["dev"], name)


def test_environment_yml_agrees_with_pyproject():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert f"pytorch>={TORCH_FLOOR}" in conda
    assert f"python{PROJECT['requires-python']}" in conda  # the same Python range
    extras = re.search(r"\.\[([\w,]+)\]", " ".join(pip)).group(1).split(",")
    assert "dev" in extras and set(extras) <= set(PROJECT["optional-dependencies"])


def test_no_file_promises_an_older_torch():
    for name in ("README.md", "environment.yml", "pyproject.toml", "Makefile", "CONTRIBUTING.md"):
        text = (ROOT / name).read_text()
        assert not re.search(r"torch\s*>=\s*2\.[0-5]\b", text), f"{name} names a torch floor below {TORCH_FLOOR}"


def test_citation_and_changelog_name_this_version():
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["version"] == cbteach.__version__ and cff["repository-code"] == cbteach.REPO_URL
    assert f"## [{cbteach.__version__}]" in (ROOT / "CHANGELOG.md").read_text()
    assert "make test" in (ROOT / ".github" / "workflows" / "ci.yml").read_text()
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_every_notebook_has_the_generated_colab_badge_and_install_cell():
    """Regenerate with `python tools/nbbuild.py --install-cells notebooks/*.ipynb`."""
    import nbformat

    sys.path.insert(0, str(ROOT))
    try:
        from tools.nbbuild import colab_problems, install_cell_source
    finally:
        sys.path.remove(str(ROOT))
    cell = install_cell_source()
    assert f"cbteach[colab] @ git+{cbteach.REPO_URL}@v{cbteach.__version__}" in cell
    problems = [p for path in sorted((ROOT / "notebooks").glob("*.ipynb"))
                for p in colab_problems(nbformat.read(path, as_version=4), path.name)]
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """cbteach's wheel, built from a copy of the checkout (nothing written into the repository)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "course", ".ipynb_checkpoints")
    shutil.copytree(ROOT / "cbteach", src / "cbteach", ignore=ignore)
    shutil.copytree(ROOT / "notebooks", src / "notebooks", ignore=ignore)
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (whl,) = (tmp / "dist").glob("cbteach-*.whl")
    return whl


def test_the_wheel_carries_the_course_the_model_and_the_licence(wheel):
    assert wheel.name.startswith(f"cbteach-{cbteach.__version__}-")
    names = zipfile.ZipFile(wheel).namelist()
    notebooks = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert sorted(n.rsplit("/", 1)[1] for n in names if n.startswith("cbteach/course/") and n.endswith(".ipynb")) \
        == notebooks
    for name in ("cbteach/course/sanitize.cfg", "cbteach/bierce/model.safetensors", "cbteach/bierce/tokenizer.json",
                 "cbteach/bierce/draft/model.safetensors", "cbteach/bierce/corpus.jsonl"):
        assert name in names
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: MIT" in meta and "Requires-Dist: matplotlib" in meta
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


def test_an_installed_wheel_writes_the_course_from_another_folder(wheel, tmp_path):
    target, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                          str(wheel)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(target), "HF_HUB_OFFLINE": "1"}

    def run(*args):
        return subprocess.run([sys.executable, *args], cwd=elsewhere, env=env, capture_output=True, text=True,
                              timeout=300)

    where = run("-c", "import cbteach, cbteach.student as s; print(cbteach.__file__); print(s.course_dir())")
    assert where.returncode == 0, where.stderr
    assert all(line.startswith(str(target)) for line in where.stdout.split())  # the wheel's copy, not the checkout
    got = run("-m", "cbteach", "notebooks", "course")
    assert got.returncode == 0, got.stderr
    assert sorted(p.name for p in (elsewhere / "course").glob("*.ipynb")) == \
        sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    again = run("-m", "cbteach", "notebooks", "course")
    assert again.returncode == 2 and "--force" in again.stderr
    student = run("-m", "cbteach", "student")  # no ./notebooks here: the course shipped in the package
    assert student.returncode == 0, student.stderr
    assert (elsewhere / "student" / "00_setup_and_first_generation.ipynb").exists()
    mask = run("-m", "cbteach", "mask", "--cached", "3,0,5", "--new", "1,4,1", "--png", "mask.png")
    assert mask.returncode == 0 and "6 queries x 14 keys" in mask.stdout, mask.stderr
    assert (elsewhere / "mask.png").read_bytes()[:4] == b"\x89PNG"
