"""Write notebooks from compact cell lists, and keep every notebook's Colab badge and install cell
generated from one place (used by the course authors; not needed by learners).

    from tools.nbbuild import md, code, solution, write
    write("notebooks/00_x.ipynb", [md("# Title"), code("print(1)"), solution("x = 1")])

Then execute it in place so outputs are stored:
    .venv/bin/jupyter nbconvert --to notebook --execute --inplace notebooks/00_x.ipynb

The Colab badge and the install cell are made from ``cbteach.REPO_URL`` and ``cbteach.__version__``
(read from ``cbteach/__init__.py``, the one place each is written). After a version bump or a move of
the repository, regenerate them in place -- only those two cells change::

    python tools/nbbuild.py --install-cells notebooks/*.ipynb
    python tools/nbbuild.py --check notebooks/*.ipynb     # exit 1 and name the notebooks that differ

The install cell pins this version (the git tag ``v<version>``) and asks for the ``colab`` extra only
(plus ``serve`` in a notebook that starts cbteach's HTTP server): Colab already has torch, numpy,
matplotlib and ipywidgets, and JupyterLab must not be installed into its runtime. Outside Colab the
cell does nothing.
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
BADGE_SVG = "https://colab.research.google.com/assets/colab-badge.svg"
BADGE_RE = re.compile(r"\[!\[Open In Colab\]\(" + re.escape(BADGE_SVG) + r"\)\]\([^)\s]*\)")
# Notebooks that ask Colab for a GPU runtime. None does: bierce is so small that a GPU step is all
# kernel-launch overhead, and every lesson (steps, slots, bytes) is the same on a CPU runtime.
GPU_NOTEBOOKS: frozenset[str] = frozenset()
# A notebook whose code mentions one of these needs the `serve` extra (fastapi, uvicorn) too.
NEEDS_SERVE = ("cbteach.serving.server", "serving.server", "cbteach.bench.endpoint")


def package_facts(init: Path = ROOT / "cbteach" / "__init__.py") -> dict:
    """``__version__`` and ``REPO_URL`` as written in ``cbteach/__init__.py`` (read, not imported:
    no torch needed, and a half-edited package cannot stop the notebooks from being fixed)."""
    facts = {}
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id in ("__version__", "REPO_URL"):
                    facts[target.id] = node.value.value
    missing = {"__version__", "REPO_URL"} - set(facts)
    if missing:
        raise ValueError(f"{init} does not assign {sorted(missing)} as plain strings")
    return facts


def git_ref(version: str) -> str:
    """The git tag a release is published under."""
    return f"v{version}"


def colab_url(name: str, facts: dict | None = None) -> str:
    facts = facts or package_facts()
    repo = facts["REPO_URL"].split("github.com/", 1)[1].rstrip("/")
    return f"https://colab.research.google.com/github/{repo}/blob/{git_ref(facts['__version__'])}/notebooks/{name}"


def badge(name: str, facts: dict | None = None) -> str:
    return f"[![Open In Colab]({BADGE_SVG})]({colab_url(name, facts)})"


def extras_for(nb) -> str:
    """The extras a notebook's Colab cell installs: ``colab``, and ``serve`` if it runs the server."""
    code = "".join("".join(c.get("source", "")) for c in nb.get("cells", []) if c.get("cell_type") == "code")
    return "colab,serve" if any(name in code for name in NEEDS_SERVE) else "colab"


def install_cell_source(facts: dict | None = None, extras: str = "colab") -> str:
    facts = facts or package_facts()
    version = facts["__version__"]
    return (f"# Colab only: install cbteach {version} (this does nothing outside Colab)\n"
            "try:\n"
            "    import google.colab  # noqa: F401\n"
            f"    %pip install -q \"cbteach[{extras}] @ git+{facts['REPO_URL']}@{git_ref(version)}\"\n"
            "except ImportError:\n"
            "    pass")


def md(src):
    return nbformat.v4.new_markdown_cell(src.strip("\n"))


def code(src, tags=()):
    cell = nbformat.v4.new_code_cell(src.strip("\n"))
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def solution(src):
    """A solution cell: tagged for `make student`, collapsed in JupyterLab."""
    cell = code(src, tags=["solution"])
    cell.metadata["jupyter"] = {"source_hidden": True}
    return cell


SETUP = ("# NBVAL_IGNORE_OUTPUT\nimport cbteach\n"
         "model, tok = cbteach.load_model()  # bierce, on this machine's best device (cuda, mps, else cpu), in fp32\n"
         "print(f\"bierce is on device {model.device.type!r}, in {model.dtype}\")")
SETUP_NO_MODEL = ("# NBVAL_IGNORE_OUTPUT\nimport cbteach\nfrom cbteach.models import pick_device\n"
                  "print(f\"cbteach {cbteach.__version__}: load_model() will put the model on {pick_device()}, "
                  "in float32\")")


def header(name, title, minutes, goals, load_model=True):
    """Title, Colab install cell and setup cell. The setup cell loads bierce and says honestly where it
    runs (``load_model=False`` for a notebook that teaches loading itself, like 00)."""
    goal_lines = "\n".join(f"- {g}" for g in goals)
    return [
        md(f"# {title}\n\n{badge(name)}\n\n**Expected time:** about {minutes} minutes.\n\n"
           f"**You will learn to**\n\n{goal_lines}"),
        code(install_cell_source()),
        code(SETUP if load_model else SETUP_NO_MODEL),
    ]


def write(path, cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    set_colab_metadata(nb, Path(path).name)
    for cell in nb.cells:  # the install cell asks for what this notebook's code needs
        if _is_install_cell(cell):
            cell.source = install_cell_source(extras=extras_for(nb))
    nbformat.write(nb, path)


# -- regenerating the Colab cells of existing notebooks ------------------------------------------
def _is_install_cell(cell) -> bool:
    return cell.cell_type == "code" and "google.colab" in "".join(cell.source)


def set_colab_metadata(nb, name: str) -> None:
    """Colab's runtime hints: a GPU runtime only for the notebooks in :data:`GPU_NOTEBOOKS`."""
    if name in GPU_NOTEBOOKS:
        nb.metadata["accelerator"] = "GPU"
        nb.metadata.setdefault("colab", {})["gpuType"] = "T4"
    else:
        nb.metadata.pop("accelerator", None)
        if isinstance(nb.metadata.get("colab"), dict):
            nb.metadata["colab"].pop("gpuType", None)


def colab_problems(nb, name: str, facts: dict | None = None) -> list[str]:
    """What differs from the generated badge and install cell (empty: the notebook is as generated)."""
    facts = facts or package_facts()
    problems = []
    first = next((c for c in nb.cells if c.cell_type == "markdown"), None)
    found = BADGE_RE.findall("".join(first.source)) if first is not None else []
    if found != [badge(name, facts)]:
        problems.append(f"{name}: the first markdown cell's Colab badge is {found or 'missing'}, "
                        f"not {badge(name, facts)}")
    cells = [c for c in nb.cells if _is_install_cell(c)]
    if len(cells) != 1:
        problems.append(f"{name}: {len(cells)} Colab install cells, want exactly one")
    elif "".join(cells[0].source) != install_cell_source(facts, extras_for(nb)):
        problems.append(f"{name}: the Colab install cell is not the generated one")
    elif nb.cells.index(cells[0]) != 1:
        problems.append(f"{name}: the Colab install cell is not the second cell")
    if (name in GPU_NOTEBOOKS) != (nb.metadata.get("accelerator") == "GPU"):
        problems.append(f"{name}: Colab accelerator metadata differs from GPU_NOTEBOOKS")
    return problems


def regenerate(path: Path, facts: dict | None = None) -> bool:
    """Rewrite ``path``'s badge and install cell (and its Colab metadata) in place, nothing else;
    returns whether the file changed."""
    facts = facts or package_facts()
    text = path.read_text(encoding="utf-8")
    nb = nbformat.reads(text, as_version=nbformat.NO_CONVERT)
    first = next((c for c in nb.cells if c.cell_type == "markdown"), None)
    if first is None or not BADGE_RE.search("".join(first.source)):
        raise ValueError(f"{path}: no Colab badge in the first markdown cell to replace")
    first.source = BADGE_RE.sub(lambda _m: badge(path.name, facts), "".join(first.source))
    cells = [c for c in nb.cells if _is_install_cell(c)]
    if len(cells) != 1:
        raise ValueError(f"{path}: {len(cells)} Colab install cells (cells mentioning google.colab); want one")
    cells[0].source = install_cell_source(facts, extras_for(nb))
    set_colab_metadata(nb, path.name)
    new = nbformat.writes(nb) + "\n"
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--install-cells", action="store_true", help="regenerate badges and install cells in place")
    mode.add_argument("--check", action="store_true", help="only report notebooks that differ (exit 1)")
    p.add_argument("notebooks", nargs="+", type=Path)
    a = p.parse_args(argv)
    facts = package_facts()
    bad = []
    for path in a.notebooks:
        if not path.is_file():
            p.error(f"{path}: no such notebook")
        if a.check:
            bad += colab_problems(nbformat.read(path, as_version=nbformat.NO_CONVERT), path.name, facts)
        else:
            try:
                changed = regenerate(path, facts)
            except ValueError as e:
                bad.append(str(e))
                continue
            print(f"{path}: {'rewritten' if changed else 'already as generated'}")
    for line in bad:
        print(line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
