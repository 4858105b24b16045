# How each venv is made: every pin and pip step, and nothing else (the Makefile includes it).
# ci/cpu.sh keeps its venvs from one run to the next while this file and pyproject.toml's
# dependency tables are unchanged, and makes them again from nothing when either changed: the
# targets, tests and settings elsewhere in the Makefile and pyproject.toml change no venv.

PYTHON ?= python3
# Where the venvs are made: in the checkout unless VENVS names a folder. A venv's path is part of the
# key inductor gives each C++ kernel it compiles (the venv's torch headers are on the compiler's
# command line), so a venv at a new path compiles every kernel again even where INDUCTOR_CACHE has
# it: ci/cpu.sh makes its venvs in one folder outside the clone, the same for every clone.
VENVS  ?= .
VENV   := $(VENVS)/.venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# The oldest stack the project supports, the one AMD's rocm/primus images run: pyproject.toml's
# lower bounds (tests/unit/test_install.py checks they agree). torch's registry wheel is a CUDA build
# that runs on a CPU.
OLDEST_TORCH      := 2.12.0
OLDEST_TORCHAO    := 0.15.0
OLDEST_TORCHTITAN := 0.2.2

# TorchTitan imports triton. CUDA and ROCm builds of torch bring their own (ROCm's under the
# distribution name pytorch-triton-rocm); CPU-only torch wheels bring none. Installed only when
# the module is missing, so a ROCm Triton is never replaced.
ensure_triton = $(1) -c "import triton" 2>/dev/null || $(1) -m pip install -q triton

# torch is pinned so pip takes the local 2.14.1 wheel instead of resolving a newer one; TORCH and
# STACK_PINS (pip requirements, e.g. "torchao==0.18.0 torchtitan==0.3.0") choose another stack, in
# another VENV (test-newest).
TORCH      ?= 2.14.1
STACK_PINS ?=

$(STAMP): pyproject.toml venvs.mk
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==$(TORCH)"
	$(PY) -m pip install -q -e ".[test,torchtitan]" $(STACK_PINS)
	$(call ensure_triton,$(PY))
	touch $@

# The newest stack the 0.3 adapter is tested on (make test-newest).
NEWEST_TORCH      := 2.15.0
NEWEST_TORCHAO    := 0.18.0
NEWEST_TORCHTITAN := 0.3.0

# TorchTitan 0.2.x and 0.3 cannot share a venv: tests/integrations/torchtitan/v0_2 runs in its own, built the same way.
VENV_TT02  := $(VENVS)/.venv-tt02
PY_TT02    := $(VENV_TT02)/bin/python
STAMP_TT02 := $(VENV_TT02)/.installed

$(STAMP_TT02): pyproject.toml venvs.mk
	test -x $(PY_TT02) || $(PYTHON) -m venv $(VENV_TT02)
	$(PY_TT02) -m pip install -q --upgrade pip
	# The main venv's torch (the local 2.14.1 wheel); test-oldest covers the oldest stack.
	$(PY_TT02) -m pip install -q "torch==2.14.1"
	$(PY_TT02) -m pip install -q -e ".[test,torchtitan02]" "torchtitan==$(OLDEST_TORCHTITAN)"
	$(call ensure_triton,$(PY_TT02))
	touch $@

# The oldest stack (make test-oldest).
VENV_OLDEST  := $(VENVS)/.venv-oldest
PY_OLDEST    := $(VENV_OLDEST)/bin/python
STAMP_OLDEST := $(VENV_OLDEST)/.installed

$(STAMP_OLDEST): pyproject.toml venvs.mk
	test -x $(PY_OLDEST) || $(PYTHON) -m venv $(VENV_OLDEST)
	$(PY_OLDEST) -m pip install -q --upgrade pip
	$(PY_OLDEST) -m pip install -q "torch==$(OLDEST_TORCH)" "torchao==$(OLDEST_TORCHAO)"
	$(PY_OLDEST) -m pip install -q -e ".[test,torchtitan02]" "torchtitan==$(OLDEST_TORCHTITAN)"
	$(call ensure_triton,$(PY_OLDEST))
	touch $@

# The canary on TorchTitan main (make test-tt-next): its wheel in shared/torchtitan-next beside the
# checkout, or beside the nearest folder above it that has one (a fresh clone in a temporary folder
# looks beside the checkout it was cloned from); TORCHTITAN_NEXT overrides the folder.
TORCHTITAN_NEXT ?= $(shell for d in '$(CURDIR)' "$$(git -C '$(CURDIR)' config --get remote.origin.url)"; do \
	[ -d "$$d" ] || continue; d=$$(cd "$$d" && pwd); while [ "$$d" != / ]; do d=$$(dirname "$$d"); \
	if [ -d "$$d/shared/torchtitan-next" ]; then echo "$$d/shared/torchtitan-next"; exit 0; fi; done; done)
VENV_TT_NEXT  := $(VENVS)/.venv-tt-next
PY_TT_NEXT    := $(VENV_TT_NEXT)/bin/python
STAMP_TT_NEXT := $(VENV_TT_NEXT)/.installed

# Where the wheel is not there (a fork's runner), pip builds the same commit from GitHub (its
# version label then reads 0.2.2, main's assets/version.txt; nothing the canary runs reads it).
TORCHTITAN_NEXT_COMMIT := b5bcd76c66d0acb1a08b176d9639425bc55e0b2a
TT_NEXT_SOURCE = $(or $(firstword $(wildcard $(TORCHTITAN_NEXT)/torchtitan-*.whl)),torchtitan @ git+https://github.com/pytorch/torchtitan@$(TORCHTITAN_NEXT_COMMIT))

$(STAMP_TT_NEXT): pyproject.toml Makefile
	test -x $(PY_TT_NEXT) || $(PYTHON) -m venv $(VENV_TT_NEXT)
	$(PY_TT_NEXT) -m pip install -q --upgrade pip
	$(PY_TT_NEXT) -m pip install -q "torch==2.14.1"
	$(PY_TT_NEXT) -m pip install -q -e ".[test]" "$(TT_NEXT_SOURCE)"
	$(call ensure_triton,$(PY_TT_NEXT))
	touch $@
