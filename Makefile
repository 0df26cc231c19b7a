# Two set-up commands on a fresh machine: `make demo` and `make test`.
# torch is pinned first so pip takes the CPU wheel instead of a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH := torch==2.13.0

.PHONY: demo test lint install install-dev bench-baselines report clean

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

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
