# The two set-up commands of the README: `make demo` and `make test`.
# Each creates .venv with Python 3.12 and installs the pinned dependencies when missing.
PYTHON ?= $(shell command -v python3.12 || (pyenv which python3.12 2>/dev/null) || echo python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo test venv clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c 'import sys; assert sys.version_info >= (3, 12), "ragdot needs Python >= 3.12; install 3.12 (pyenv reads .python-version)"'
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,moe,bench]'
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m ragdot.demo

test: $(STAMP)
	$(PY) -m pytest -m "not gpu" -n 2 -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
