# Two set-up commands on a fresh machine: `make demo` and `make test` (`make test-all`: every test).
# torch is pinned first so pip takes the CPU wheel instead of a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH := torch==2.13.0

.PHONY: demo test test-slow test-all lint install install-dev bench-baselines bench-gpu report clean fuzz corpus reproduce docs

$(VENV)/.installed: pyproject.toml benchmarks/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $(TORCH)
	$(PIP) install --quiet -e ".[all]"
	$(PIP) install --quiet --no-deps -e benchmarks
	touch $@

# tools/torchvision_cpu: PyPI's torchvision (a CUDA build) imports beside the CPU torch
$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install --quiet -e ".[dev]"
	$(PY) tools/torchvision_cpu/install.py
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

demo: install
	$(VENV)/bin/leangrad demo

# A contributor's loop: every test but the long end-to-end runs (suites, full plans,
# torchrun matrices, the Hypothesis fuzz; marked `slow`), on every core (pytest-xdist).
# `make test-all` runs every test; CI runs `make test`, then `make test-slow`.
PYTEST_WORKERS ?= auto
test: install-dev lint docs
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) -m "not slow"

# The tests `make test` leaves out (CI runs them after `make test`).
test-slow: install-dev
	LEANGRAD_TEST_ALL=1 $(PY) -m pytest -q -n $(PYTEST_WORKERS) -m slow

test-all: install-dev lint docs
	LEANGRAD_TEST_ALL=1 $(PY) -m pytest -q -n $(PYTEST_WORKERS)

lint: install-dev
	$(VENV)/bin/ruff check src benchmarks tests tools
	$(VENV)/bin/mypy

# The documentation site: docs/ built by MkDocs (mkdocs.yml) into site/; any warning fails it.
docs: install-dev
	$(VENV)/bin/mkdocs build --strict --quiet

# The engine fuzz test's long profile: 2,000 drawn models, every engine against
# autograd. FUZZ_COLLECT=1 logs every failure and goes on (the summary counts them);
# FUZZ_COLLECT=0 stops at the first and lets Hypothesis shrink it. Fails on any new failure.
FUZZ_LOG ?= build/fuzz-log.jsonl
FUZZ_COLLECT ?= 1
# It then holds every engine to autograd on the whole corpus of models people download
# (tests/model_corpus.py: timm and torchvision; `make test` runs its fast slice).
fuzz: install-dev
	@mkdir -p $(dir $(FUZZ_LOG)) && rm -f $(FUZZ_LOG)
	HYPOTHESIS_PROFILE=fuzz FUZZ_LOG=$(FUZZ_LOG) FUZZ_COLLECT=$(FUZZ_COLLECT) \
	  $(PY) -m pytest -q tests/engines/test_fuzz.py; rc=$$?; \
	  $(PY) tests/fuzz_models.py summarize $(FUZZ_LOG) || rc=1; \
	  LEANGRAD_CORPUS=all $(PY) -m pytest -q tests/test_model_corpus.py || rc=1; exit $$rc

# The model corpus's table (model x engine: exact, or refused and why) and the peers'
# BatchNorm double update, into results/model-corpus.{json,md}.
corpus: install-dev
	$(PY) tests/model_corpus.py --all --out results/model-corpus

# Every published number from today's code, alone on the machine: each suite's quick run
# into results/, results/report.md, and the README's and docs/'s generated tables.
# SUITES=a,b runs some; FULL=gpt,resnet re-runs those zoo models at full size (one at a time).
SUITES ?=
FULL ?=
reproduce: install-dev
	$(PY) tools/reproduce.py $(if $(SUITES),--suites $(SUITES)) $(if $(FULL),--full $(FULL))

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
