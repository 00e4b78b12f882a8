"""JupyterLab settings for ``make lab`` (``jupyter lab --config=tools/lab_config.py``).

* The server's root is the repository, so both ``notebooks/`` (the course with its solutions) and
  ``student/`` (``make student``: the copy with stubs) are in the file browser; the engine's source,
  tests, tools and the instructor kit are hidden from it (they are still on disk).
* It listens on 127.0.0.1 only and opens notebook 00.
* As root (containers, CI images) JupyterLab refuses to start unless told it may.
"""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
c = get_config()  # noqa: F821  (provided by Jupyter when it reads this file)

c.ServerApp.ip = "127.0.0.1"
c.ServerApp.root_dir = str(ROOT)
c.ServerApp.allow_root = hasattr(os, "geteuid") and os.geteuid() == 0
c.LabApp.default_url = "/lab/tree/notebooks/00_setup_and_first_generation.ipynb"
c.ContentsManager.hide_globs = [
    "__pycache__", "*.pyc", "*.pyo", ".DS_Store", "*~",  # Jupyter's defaults
    "INSTRUCTOR.md", "sanitize.cfg", "cbteach", "tests", "tools", "benchmarks", "docs", "build", "dist",
    "site", "*.egg-info", "Makefile", "setup.py", "MANIFEST.in", "pyproject.toml", "environment.yml",
    "CITATION.cff",
]
