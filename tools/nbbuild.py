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


def header(name, title, minutes, goals):
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
        code("# NBVAL_IGNORE_OUTPUT\nimport cbteach\nfrom cbteach.models import pick_device\n"
             "print('device available:', pick_device(), '- the course runs on the CPU, where fp32 is exact')"),
    ]


def write(path, cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nbformat.write(nb, path)
