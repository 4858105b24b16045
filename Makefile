# `make test` and `make demo` set themselves up: .venv is created when missing and everything the
# project needs is installed into it from pyproject.toml.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# One thread per process: on 2-core machines 2 threads made training steps 3-15x slower.
RUN    := OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/.venv/inductor-cache

.PHONY: setup test test-tt02 demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned here so pip takes the local 2.14.1 wheel instead of resolving a newer one.
	$(PY) -m pip install -q "torch==2.14.1"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

test: $(STAMP)
	$(RUN) $(PY) -m pytest -q

demo: $(STAMP)
	$(RUN) $(PY) examples/demo.py $(if $(RECIPE),--recipe $(RECIPE))

# TorchTitan 0.2.x and 0.3 cannot share a venv: tests_tt02 runs in its own, built the same way.
VENV_TT02  := .venv-tt02
PY_TT02    := $(VENV_TT02)/bin/python
STAMP_TT02 := $(VENV_TT02)/.installed

$(STAMP_TT02): pyproject.toml
	test -x $(PY_TT02) || $(PYTHON) -m venv $(VENV_TT02)
	$(PY_TT02) -m pip install -q --upgrade pip
	# The main venv's torch (the local 2.14.1 wheel): torchtitan 0.2.2 declares no torch
	# requirement, and runs on 2.13 and 2.14 alike; the core needs >= 2.14.
	$(PY_TT02) -m pip install -q "torch==2.14.1"
	$(PY_TT02) -m pip install -q -e ".[test]" "torchtitan==0.2.2"
	touch $@

test-tt02: $(STAMP_TT02)
	$(RUN) $(PY_TT02) -m pytest -q tests_tt02

clean:
	rm -rf $(VENV) $(VENV_TT02) outputs .pytest_cache
