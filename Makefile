# `make test` and `make demo` set themselves up: .venv is created when missing and everything the
# project needs is installed into it from pyproject.toml.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# One thread per process: on 2-core machines 2 threads made training steps 3-15x slower.
RUN    := OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/.venv/inductor-cache

.PHONY: setup test demo clean

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
	$(RUN) $(PY) examples/demo.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
