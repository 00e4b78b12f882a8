"""JupyterLab settings for ``make lab`` and ``make lab-solutions``
(``jupyter lab --config=tools/lab_config.py``).

Which copy of the course it opens is ``CBTEACH_LAB`` (read when JupyterLab starts):

* ``student`` (the default: ``make lab``, or the plain command) -- the learners' copy in ``student/``
  (``python -m cbteach student notebooks student`` writes it; ``make lab`` does so when it is missing).
  The copy with the solutions, ``notebooks/``, is hidden from the file browser; ``cbteach/`` -- the
  engine whose files notebooks 03, 05, 06 and 12 send learners to read -- is shown.
* ``solutions`` (``make lab-solutions``) -- the instructor's view: ``notebooks/`` with the solutions,
  the instructor kit and the workshop kit, beside ``student/`` and ``cbteach/``.

Either way the server's root is the repository (so a notebook's link to ``../cbteach/...`` opens), it
listens on 127.0.0.1 only, and the tests, tools and build files are hidden. Hiding is only for the
file browser -- the files stay on disk and a learner who types a path can still open one: this keeps
the room's attention on the course, it is no lock on the solutions. As root (containers, CI images)
JupyterLab refuses to start unless told it may.
"""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIES = {"student": "student", "solutions": "notebooks"}  # CBTEACH_LAB -> the folder it opens
FIRST = "00_setup_and_first_generation.ipynb"
JUPYTER_DEFAULTS = ["__pycache__", "*.pyc", "*.pyo", ".DS_Store", "*~"]
# Never in the file browser: what neither learners nor instructors open during a session.
ALWAYS_HIDDEN = ["sanitize.cfg", "tests", "tools", "benchmarks", "docs", "build", "dist", "site", "*.egg-info",
                 "Makefile", "setup.py", "MANIFEST.in", "pyproject.toml", "environment.yml", "CITATION.cff",
                 "wheelhouse", "handouts"]
# Hidden from learners only: the solutions, in the checkout and in the copy a wheel build puts into
# cbteach/course/, and the instructor's pages.
SOLUTIONS = ["notebooks", "course", "INSTRUCTOR.md", "WORKSHOP_KIT.md"]


def settings(copy: str) -> dict:
    """The settings for ``copy`` (``student`` or ``solutions``); a ValueError names the allowed ones."""
    if copy not in COPIES:
        raise ValueError(f"CBTEACH_LAB={copy!r}: use 'student' (the learners' copy, the default) or 'solutions' "
                         "(the course with its solutions, for instructors)")
    hidden = JUPYTER_DEFAULTS + ALWAYS_HIDDEN + (SOLUTIONS if copy == "student" else [])
    return {"root_dir": str(ROOT), "default_url": f"/lab/tree/{COPIES[copy]}/{FIRST}", "hide_globs": hidden}


if "get_config" in globals():  # read by Jupyter (which provides get_config); importing it only defines the above
    try:
        s = settings(os.environ.get("CBTEACH_LAB", "student"))
    except ValueError as err:  # Jupyter logs a config file's exceptions and starts anyway: stop instead
        print(f"tools/lab_config.py: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    c = get_config()  # noqa: F821
    c.ServerApp.ip = "127.0.0.1"
    c.ServerApp.root_dir = s["root_dir"]
    c.ServerApp.allow_root = hasattr(os, "geteuid") and os.geteuid() == 0
    c.LabApp.default_url = s["default_url"]
    c.ContentsManager.hide_globs = s["hide_globs"]
