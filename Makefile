# Two set-up commands on a fresh machine: `make demo` and `make test`.
# torch is pinned first so pip takes the CPU wheel instead of a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH := torch==2.13.0

.PHONY: demo test lint install install-dev bench-baselines bench-gpu report clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $(TORCH)
	$(PIP) install --quiet -e ".[all]"
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install --quiet -e ".[dev]"
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

demo: install
	$(VENV)/bin/leangrad demo

test: install-dev
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy
	$(PY) -m pytest -q

bench-baselines: install
	$(VENV)/bin/leangrad bench baselines --quick --out results
	$(VENV)/bin/leangrad report results

# On a machine with CUDA: every engine's exactness test on the GPU, then the headline suites
# with --device cuda (CUDA-allocator peaks, absolute times) into results/cuda.
GPU_SUITES := baselines moonwalk-v1-revnet moonwalk-v2-cnn highway-rnn fad rad-variance
bench-gpu: install-dev
	@$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else \
	  'make bench-gpu: torch.cuda.is_available() is False here (torch ' + torch.__version__ + ')')"
	LEANGRAD_TEST_DEVICE=cuda $(PY) -m pytest -q tests/engines/test_engines.py
	for s in $(GPU_SUITES); do $(VENV)/bin/leangrad bench $$s --quick --device cuda \
	  --out results/cuda || exit 1; done
	$(VENV)/bin/leangrad report results/cuda

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
