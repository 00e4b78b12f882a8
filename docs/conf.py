"""Sphinx configuration of the course website (``make book``; staged and built by tools/build_site.py).

The pages are the notebooks *as stored* -- with the outputs nbval checks -- rendered by myst-nb with
execution off, so building the site runs nothing and fetches nothing. tools/build_site.py stages
the sources next to this file (README as the front page, the notebooks, the instructor kit, the
glossary) and passes the facts below in ``html_context``.
"""
import json
import os

project = "cbteach"
author = "The cbteach authors"
copyright = "2026, the cbteach authors (MIT licence)"
FACTS = json.loads(os.environ.get("CBTEACH_SITE_FACTS", "{}"))
release = version = FACTS.get("version", "")

extensions = ["myst_nb"]
nb_execution_mode = "off"            # the stored outputs are the page: nothing is executed
nb_output_stderr = "show"
nb_merge_streams = True
myst_heading_anchors = 3             # README's #anchors keep working
myst_enable_extensions = ["colon_fence"]
exclude_patterns = ["_build", "**.ipynb_checkpoints", "notebooks"]  # notebooks/: downloads
suppress_warnings = ["myst.header", "misc.highlighting_failure", "myst.xref_missing"]

html_theme = "furo"
html_title = f"cbteach {release}: continuous batching, taught"
html_static_path = ["_static"]
html_css_files = ["cbteach.css"]
html_copy_source = False
html_show_sourcelink = False
html_context = {"cbteach": FACTS}


def _links(app, pagename, templatename, context, doctree):
    """Every page starts with where to run it: Colab for a notebook page (the course's start
    otherwise), the notebook file itself, and the two local ways."""
    if doctree is None or "body" not in context:
        return
    notebooks = FACTS.get("notebooks", {})
    name = notebooks.get(pagename) or FACTS.get("first_notebook", "")
    colab = FACTS.get("colab", "").format(name=name)
    prefix = "../" * pagename.count("/")
    items = [f'<a class="cbteach-colab" href="{colab}">Open {"this notebook" if pagename in notebooks else "the course"}'
             ' in Colab</a>']
    if pagename in notebooks:
        items.append(f'<a class="cbteach-download" href="{prefix}notebooks/{name}" download>Download the notebook</a>')
    spec = FACTS.get("pip_spec", "cbteach").replace("cbteach @", "cbteach[lab] @", 1)
    items.append(f'<a class="cbteach-local" href="{prefix}index.html#run-it-locally">Run it locally</a>: '
                 "(Linux) <code>pip install torch --index-url https://download.pytorch.org/whl/cpu</code>, "
                 f"<code>pip install \"{spec}\"</code>, then "
                 "<code>python -m cbteach notebooks course</code> and <code>jupyter lab course</code> -- "
                 "or <code>make lab</code> in a clone")
    context["body"] = '<div class="cbteach-run">' + " · ".join(items) + "</div>\n" + context["body"]


def setup(app):
    app.connect("html-page-context", _links)
