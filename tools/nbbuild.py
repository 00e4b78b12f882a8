"""Write a notebook from a compact cell list (used by the course authors; not needed by learners).

    from tools.nbbuild import md, code, solution, write
    write("notebooks/00_x.ipynb", [md("# Title"), code("print(1)"), solution("x = 1")])

Then execute it in place so outputs are stored:
    .venv/bin/jupyter nbconvert --to notebook --execute --inplace notebooks/00_x.ipynb
"""
from __future__ import annotations

import nbformat

import cbteach

COLAB = ("https://colab.research.google.com/github/" + cbteach.REPO_URL.split("github.com/")[1]
         + "/blob/main/notebooks/{name}")


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
    badge = f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({COLAB.format(name=name)})"
    goal_lines = "\n".join(f"- {g}" for g in goals)
    return [
        md(f"# {title}\n\n{badge}\n\n**Expected time:** about {minutes} minutes.\n\n**You will learn to**\n\n{goal_lines}"),
        code(
            "# Colab only: install cbteach (this does nothing outside Colab)\n"
            "try:\n"
            "    import google.colab  # noqa: F401\n"
            f"    %pip install -q \"cbteach[lab] @ git+{cbteach.REPO_URL}\"\n"
            "except ImportError:\n"
            "    pass"
        ),
        code(SETUP if load_model else SETUP_NO_MODEL),
    ]


def write(path, cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nbformat.write(nb, path)
