# cbteach -- two commands on a fresh clone: `make demo` and `make test`.
# Each creates .venv when it is missing: the CPU build of torch first (a bare `torch` requirement
# would pull a multi-GB CUDA build), then the package with its dev and lab extras.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0

.PHONY: demo test test-fast lab student bench gpu-check browser-deps clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev,lab]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m cbteach demo

test: $(VENV)/.installed browser-deps
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider tests notebooks \
		--nbval --nbval-sanitize-with notebooks/sanitize.cfg

test-fast: $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q tests -x

lab: $(VENV)/.installed
	$(VENV)/bin/jupyter lab notebooks/

student: $(VENV)/.installed
	$(PY) -m cbteach student notebooks student

bench: $(VENV)/.installed
	$(PY) -m cbteach bench

# On a machine with a GPU: notebooks, fp32 exactness and the speed comparison in one run
# (under 5 minutes on one H200); writes benchmarks/results/gpu.json. `--small` runs it on a CPU.
gpu-check: $(VENV)/.installed
	$(PY) tools/gpu_check.py

# The browser test drives JupyterLab in Debian's Chromium (Playwright's own browser download is
# not reachable here). Where Chromium cannot be installed (no root, no apt) the test skips and says so.
browser-deps:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -q && apt-get install -y -q chromium) >/dev/null 2>&1 \
		|| echo "note: chromium could not be installed; tests/test_browser.py will be skipped"

clean:
	rm -rf $(VENV) student .pytest_cache .hypothesis
