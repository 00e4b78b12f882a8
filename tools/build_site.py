#!/usr/bin/env python
"""Build the course as a static website (``make book``): Sphinx + myst-nb from the stored notebooks.

    python tools/build_site.py --out site        # then open site/index.html

Nothing is executed and nothing is fetched: each page is a notebook as stored, with the outputs
nbval checks (figures, ASCII masks, tables). The sources are staged in ``<out>/_src`` first:

* ``index.md`` -- the README, the front page, with links into the repository made absolute
  (``notebooks/X.ipynb`` links stay inside the site);
* one page per ``notebooks/*.ipynb``, its widget outputs replaced by their last drawn image (a static
  page has no kernel to run a slider; the state Jupyter saved in the notebook holds the image), and
  the saved widget state dropped (it would make the page load widget code from a CDN);
* ``instructor.md`` (notebooks/INSTRUCTOR.md), ``glossary.md`` (the README's glossary table),
  ``contributing.md`` and ``changelog.md``;
* the notebooks themselves, copied into the site's ``notebooks/`` for each page's download link.

The staging folder and Sphinx's cache are in ``build/site/``; the site itself in ``--out``.

``docs/conf.py`` is the Sphinx configuration; it adds the "Open in Colab" / "run locally" bar to
every page. Sphinx's own search (a JS index, no server) finds names like ``block_table``.
"""
from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from nbbuild import BADGE_SVG, colab_url, git_ref, package_facts  # noqa: E402

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
EXTRA_PAGES = {"instructor.md": "notebooks/INSTRUCTOR.md", "contributing.md": "CONTRIBUTING.md",
               "changelog.md": "CHANGELOG.md"}
IMG_SRC = re.compile(r"""<img[^>]*\bsrc=["']([^"']+)["']|!\[[^\]]*\]\(([^)\s]+)\)""")
IMAGE = re.compile(r"\.(png|jpe?g|gif|svg)$", re.I)
LINK = re.compile(r"(\]\()([^)\s#]+)(#[^)\s]*)?(\))")


def rewrite_links(text: str, base: str, site_pages: dict[str, str], blob: str) -> str:
    """Markdown links relative to ``base`` (a folder of the repository): to a page of the site if the
    target is one, else to the file on the repository's web page. Absolute URLs stay as they are."""
    def fix(m):
        target = m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/") or IMAGE.search(target):
            return m.group(0)  # a URL, or a picture (copied into the site where it is)
        path = os.path.normpath(os.path.join(base, target)).replace(os.sep, "/")
        new = site_pages.get(path, f"{blob}/{path}")
        return f"{m.group(1)}{new}{m.group(3) or ''}{m.group(4)}"
    return LINK.sub(fix, text)


def _widget_image(state: dict, model_id: str, seen=None) -> dict | None:
    """The last image a widget (or any widget inside it) drew, from the notebook's saved widget state."""
    seen = seen if seen is not None else set()
    if model_id in seen or model_id not in state:
        return None
    seen.add(model_id)
    model = state[model_id].get("state", {})
    for out in reversed(model.get("outputs", [])):  # an Output widget: what was displayed in it
        data = out.get("data", {})
        if "image/png" in data:
            return {"image/png": data["image/png"], "text/plain": data.get("text/plain", "<figure>")}
    found = None
    for child in model.get("children", []):  # a box: the last child with an image wins
        if isinstance(child, str) and child.startswith("IPY_MODEL_"):
            found = _widget_image(state, child[len("IPY_MODEL_"):], seen) or found
    return found


def _widget_text(state: dict, model_id: str, seen=None) -> str:
    """The text a widget shows (HTML and Label values, in order): e.g. a finished tqdm bar."""
    seen = seen if seen is not None else set()
    if model_id in seen or model_id not in state:
        return ""
    seen.add(model_id)
    entry = state[model_id]
    model = entry.get("state", {})
    if entry.get("model_name") in ("HTMLModel", "LabelModel") and isinstance(model.get("value"), str):
        return html.unescape(re.sub(r"<[^>]+>", "", model["value"])).replace("\u2007", " ")
    parts = [_widget_text(state, c[len("IPY_MODEL_"):], seen) for c in model.get("children", [])
             if isinstance(c, str) and c.startswith("IPY_MODEL_")]
    return " ".join(p for p in parts if p.strip())


def static_notebook(nb: dict) -> dict:
    """A copy fit for a static page: widgets become their last image, the widget state is dropped."""
    nb = json.loads(json.dumps(nb))
    state = nb.get("metadata", {}).pop("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET_VIEW in data:
                image = _widget_image(state, data[WIDGET_VIEW].get("model_id", ""))
                text = _widget_text(state, data[WIDGET_VIEW].get("model_id", "")).strip()
                out["data"] = image or {"text/plain": text or "(an interactive widget: run the notebook to use it)"}
    return nb


def glossary_page(readme: str) -> str:
    m = re.search(r"^#+ Glossary[^\n]*\n(.*?)(?=^#+ )", readme, flags=re.S | re.M)
    body = m.group(1).strip() if m else "(The glossary is in the README.)"
    return ("# Glossary\n\ncbteach's names and the field's: vLLM's and transformers' continuous batching. "
            "Notebook 10 follows one request through the engine with these names.\n\n" + body + "\n")


def stage(src: Path, facts: dict) -> dict:
    """Write the site's sources into ``src``; returns the facts conf.py reads."""
    if src.exists():
        shutil.rmtree(src)
    shutil.copytree(ROOT / "docs", src, ignore=shutil.ignore_patterns("_build", "__pycache__"))
    blob = f"{facts['REPO_URL'].rstrip('/')}/blob/{git_ref(facts['__version__'])}"
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    if not notebooks:
        raise SystemExit(f"build_site: no notebooks in {ROOT / 'notebooks'}")
    pages = {f"notebooks/{p.name}": p.name for p in notebooks}
    pages.update({repo_path: page for page, repo_path in EXTRA_PAGES.items()})
    pages.update({"README.md": "index.md", "LICENSE": f"{blob}/LICENSE"})
    (src / "notebooks").mkdir()
    for path in notebooks:
        nb = json.loads(path.read_text(encoding="utf-8"))
        for cell in nb.get("cells", []):
            if cell.get("cell_type") == "markdown":
                text = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
                text = text.replace(BADGE_SVG, "_static/colab-badge.svg")  # the site loads nothing from outside
                cell["source"] = rewrite_links(text, "notebooks", pages, blob)
        (src / path.name).write_text(json.dumps(static_notebook(nb), indent=1, ensure_ascii=False), encoding="utf-8")
        shutil.copy(path, src / "notebooks" / path.name)  # the download link's target, outputs and all
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    toc = "\n".join(["", "```{toctree}", ":hidden:", ":caption: The course", ""] + [p.stem for p in notebooks]
                    + ["```", "", "```{toctree}", ":hidden:", ":caption: Around it", "", "glossary", "instructor",
                       "contributing", "changelog", "```", ""])
    (src / "index.md").write_text(rewrite_links(readme, ".", pages, blob) + toc, encoding="utf-8")
    (src / "glossary.md").write_text(glossary_page(readme), encoding="utf-8")
    for page, repo_path in EXTRA_PAGES.items():
        text = (ROOT / repo_path).read_text(encoding="utf-8")
        (src / page).write_text(rewrite_links(text, str(Path(repo_path).parent), pages, blob), encoding="utf-8")
    found = {a or b for a, b in IMG_SRC.findall(readme)}
    assets = sorted(m for m in found if not re.match(r"^[a-z]+:", m) and (ROOT / m).is_file())
    for asset in assets:  # README's pictures (raw <img> tags pass through Sphinx as they are)
        (src / asset).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / asset, src / asset)
    version = facts["__version__"]
    return {"assets": assets, "version": version, "first_notebook": notebooks[0].name,
            "colab": colab_url("{name}", facts), "notebooks": {p.stem: p.name for p in notebooks},
            "pip_spec": f"cbteach @ git+{facts['REPO_URL']}@{git_ref(version)}"}


def build(site: Path, work: Path = ROOT / "build" / "site", quiet: bool = True) -> Path:
    """Stage the sources in ``work`` and build the site into ``site`` (replaced); returns ``site``."""
    facts = package_facts()
    src = work / "_src"
    site_facts = stage(src, facts)
    if site.exists() and any(site.iterdir()):
        if not (site / "searchindex.js").exists() or site in ROOT.parents or site == ROOT:
            raise SystemExit(f"build_site: {site} is not empty and not an earlier build of the site; "
                             "give an empty or new folder")
        shutil.rmtree(site)
    if (work / "html").exists():
        shutil.rmtree(work / "html")
    env = {**os.environ, "CBTEACH_SITE_FACTS": json.dumps(site_facts)}
    # Sphinx writes into work/html (myst-nb puts its jupyter_execute/ folder beside that), then the
    # finished site is copied to ``site``.
    built = work / "html"
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-j", "1", "-E", "-d", str(work / "_doctrees"), str(src),
           str(built)] + (["-q"] if quiet else [])
    result = subprocess.run(cmd, env=env, text=True, capture_output=True)
    if result.returncode != 0:
        sys.stderr.write(result.stdout[-4000:] + result.stderr[-4000:])
        raise SystemExit(f"build_site: sphinx failed (exit {result.returncode})")
    for line in result.stderr.splitlines():
        if "WARNING" in line or "ERROR" in line:
            print(line, file=sys.stderr)
    shutil.copytree(built, site, dirs_exist_ok=True)
    shutil.copytree(src / "notebooks", site / "notebooks", dirs_exist_ok=True)
    for asset in site_facts["assets"]:
        (site / asset).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / asset, site / asset)
    return site


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "site", help="the website's folder (default: site/)")
    p.add_argument("--verbose", action="store_true", help="show Sphinx's progress")
    a = p.parse_args(argv)
    site = build(a.out.resolve(), quiet=not a.verbose)
    print(f"build_site: the course website is in {site} (open {site / 'index.html'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
