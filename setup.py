"""Build step that pyproject.toml cannot express: ship the course notebooks inside the wheel.

The notebooks live in ``notebooks/`` at the top of the repository (where learners and JupyterLab
find them). When a wheel is built, they are copied into the package as ``cbteach/course/`` so that
``python -m cbteach notebooks DIR`` can write them out from an installed package. In a checkout
(or an editable install) nothing is copied: :func:`cbteach.student.course_dir` reads ``notebooks/``.
"""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
COURSE_FILES = ("*.ipynb", "INSTRUCTOR.md", "WORKSHOP_KIT.md", "sanitize.cfg")


class BuildPyWithCourse(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        src = ROOT / "notebooks"
        dst = Path(self.build_lib) / "cbteach" / "course"
        found = sorted(p for pattern in COURSE_FILES for p in src.glob(pattern))
        if not any(p.suffix == ".ipynb" for p in found):
            raise SystemExit(f"setup.py: no notebooks in {src}; the wheel would ship without the course")
        dst.mkdir(parents=True, exist_ok=True)
        for path in found:
            self.copy_file(str(path), str(dst / path.name))


setup(cmdclass={"build_py": BuildPyWithCourse})
