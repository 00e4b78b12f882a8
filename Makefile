# cbteach -- two commands on a fresh clone: `make demo` and `make test`.
# Each creates .venv when it is missing and installs into it, in this order:
#   1. torch's CPU build (tools/install_torch.py): an installed torch >= 2.6 is kept; else on Linux
#      PyTorch's CPU wheel index when it answers, else $(TORCH) from the ordinary index. A bare `torch`
#      requirement would pull the multi-GB CUDA build on Linux; this step comes first so it never does.
#   2. the package, editable, with the extras the targets use: dev (tests, linter, website), lab, serve;
#      `make test` adds kernels (Triton, for the paged-attention kernel's tests), `make demo` does not.

PYTHON      ?= python3
VENV        := .venv
PY          := $(VENV)/bin/python
TORCH       ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
EXTRAS      ?= dev,lab,serve
SITE        := site
OFFLINE     := HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
BUSY        ?= 2

.PHONY: install demo test test-busy test-fast lint lab lab-solutions handouts wheelhouse student notebooks outputs bench gpu-check book browser-deps clean

$(VENV)/.installed: pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) tools/install_torch.py --index-url "$(TORCH_INDEX)" --fallback "$(TORCH)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

# Triton for the kernel's tests (notebook 05b, tests/test_triton_attention.py); the demo never needs it.
$(VENV)/.kernels: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[kernels]"
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m cbteach demo

# The linter first (seconds), then the website, then every test and every notebook under nbval.
test: $(VENV)/.installed $(VENV)/.kernels browser-deps
	$(VENV)/bin/ruff check .
	$(OFFLINE) $(PY) tools/build_site.py --out $(SITE)
	$(OFFLINE) $(PY) -m pytest -q -p no:cacheprovider tests notebooks \
		--nbval --nbval-sanitize-with notebooks/sanitize.cfg

# Every test and notebook again, on a machine loaded on purpose: $(BUSY) processes loop in Python beside
# the tests for the whole run (tests/conftest.py's --busy), as on a laptop doing other things or a shared
# CI machine. A test that fails here and not in `make test` waits for time, not for the state it needs.
test-busy: $(VENV)/.installed $(VENV)/.kernels browser-deps
	$(OFFLINE) $(PY) -m pytest -q -p no:cacheprovider tests notebooks --busy $(BUSY) \
		--nbval --nbval-sanitize-with notebooks/sanitize.cfg

test-fast: $(VENV)/.installed $(VENV)/.kernels
	$(OFFLINE) $(PY) -m pytest -q tests -x

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

# JupyterLab on 127.0.0.1 only, rooted at the repository (tools/lab_config.py). `make lab` opens the
# learners' copy, student/ (written first when it is missing; an existing one is kept, with any work in
# it), with cbteach/ in the file browser -- notebooks 03, 05, 06, 06b and 12 send learners to read its files --
# and notebooks/ (the solutions) hidden. `make lab-solutions` opens notebooks/, for instructors.
# Without make (Windows): `python -m cbteach student notebooks student`, then
# `jupyter lab --config=tools/lab_config.py`; for the solutions set CBTEACH_LAB=solutions first.
lab: $(VENV)/.installed
	test -f student/00_setup_and_first_generation.ipynb || $(PY) -m cbteach student notebooks student
	CBTEACH_LAB=student $(VENV)/bin/jupyter lab --config=tools/lab_config.py

lab-solutions: $(VENV)/.installed
	CBTEACH_LAB=solutions $(VENV)/bin/jupyter lab --config=tools/lab_config.py

# The workshop kit (notebooks/WORKSHOP_KIT.md): one Markdown handout per exercise from the notebooks'
# solution cells, and an offline wheelhouse -- torch's CPU wheel, cbteach's own wheel and every wheel
# `cbteach[lab]` needs, for this machine's OS and Python -- to install a room's laptops without a network
# (`pip install --no-index --find-links wheelhouse "cbteach[lab]"` on each).
handouts:
	$(PYTHON) tools/handouts.py --out handouts

wheelhouse: $(VENV)/.installed
	$(PY) -m pip download -q -d wheelhouse --index-url "$(TORCH_INDEX)" "$(TORCH)"
	$(PY) -m pip wheel -q --no-deps -w wheelhouse .
	$(PY) -m pip download -q -d wheelhouse --find-links wheelhouse "$$(ls wheelhouse/cbteach-*.whl)[lab]" "$(TORCH)"
	@echo "wheelhouse/: $$(ls wheelhouse | wc -l) files, $$(du -sh wheelhouse | cut -f1)"

student: $(VENV)/.installed
	$(PY) -m cbteach student notebooks student

# Execute every notebook in place to store its outputs -- on a quiet machine only: it refuses to start
# while the 1-minute load average is 1 or more (tools/store_outputs.py --force overrides, for drafts).
outputs: $(VENV)/.installed
	$(OFFLINE) $(PY) tools/store_outputs.py

bench: $(VENV)/.installed
	$(PY) -m cbteach bench

# On a machine with a GPU: notebooks, fp32 exactness and the speed comparison in one run
# (under 5 minutes on one H200); writes benchmarks/results/gpu.json. Without a GPU it stops at once
# and says so; `$(PY) tools/gpu_check.py --small` is the CPU version (tiny sizes, seconds).
gpu-check: $(VENV)/.installed
	$(PY) tools/gpu_check.py

# The course as a static website in $(SITE)/ (Sphinx + myst-nb, from the notebooks' stored outputs;
# nothing is executed and nothing is fetched). Open $(SITE)/index.html; sources staged in build/site/.
book: $(VENV)/.installed
	$(OFFLINE) $(PY) tools/build_site.py --out $(SITE)

# The browser tests drive Debian's Chromium (Playwright's own browser download is not reachable
# here). Where Chromium cannot be installed (no root, no apt) they skip and say so.
browser-deps:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -q && apt-get install -y -q chromium) >/dev/null 2>&1 \
		|| echo "note: chromium could not be installed; tests/test_browser.py and tests/test_site.py will be skipped"

clean:
	rm -rf $(VENV) student $(SITE) build dist .pytest_cache .hypothesis .ruff_cache
