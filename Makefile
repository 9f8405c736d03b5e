# Two commands do all the set-up: `make demo` and `make test`.
# The virtual environment keeps a torch that the calling python already has (e.g. a CUDA build);
# otherwise it installs the CPU build torch==2.13.0 (from the local wheel cache where one exists).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test demo parity-demo bench clean mutations mutations-ci

setup: $(STAMP)

$(STAMP): pyproject.toml
	@if [ ! -x $(PY) ]; then \
	  if $(PYTHON) -c "import torch" 2>/dev/null; then \
	    echo "using the torch of $(PYTHON)"; $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else $(PYTHON) -m venv $(VENV); fi; fi
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0" || $(PY) -m pip install -q torch
	$(PY) -m pip install -q -e ".[test]"
	@touch $(STAMP)

test: setup
	$(PY) -m pytest -q tests

# switch features off one at a time; the tests named for each must fail (tests/helpers/mutations.py)
mutations: setup
	$(PY) tests/helpers/mutations.py

# CI's form (.ci/run, after `make test`): mutations whose fingerprint (patch, code switched off, named tests) changed
# since the last whole audit run whole; the others in rotating slots of MUTATION_BUDGET seconds, each by its fastest
# test, so that every one runs within a stated number of CI runs (MUTATION_ROTATION: a CI run counter, if any)
MUTATION_BUDGET ?= 300
mutations-ci: setup
	$(PY) tests/helpers/mutations.py --ci $(MUTATION_BUDGET)

demo: setup
	$(PY) -m colozoo.demo_finetune

bench: setup
	$(PY) -m pip install -q -e ".[test,bench]"
	$(PY) bench/run_benchmarks.py

clean:
	rm -rf $(VENV) build *.egg-info

parity-demo: setup
	$(PY) -m colozoo.demo
