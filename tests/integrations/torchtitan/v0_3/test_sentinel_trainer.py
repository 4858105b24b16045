"""The numerics sentinel in TorchTitan 0.3's real trainer (torchrun, CPU launcher): a corrupted
backend installed as a plugin (an entry point, as pip would install one) is caught on the first
checked step with the layer named, and two FSDP2 ranks train exactly as with the sentinel off."""

import json
import os
import re
from pathlib import Path

from support import corrupt_backend
import pytest
from support.repo_root import ROOT, TESTS
from support.titan_helpers import run_trainer

pytestmark = pytest.mark.trainer


def fp8(**options) -> tuple[str, str]:
    return "--override.imports", f"titan_primus.torchtitan.overrides.fp8={json.dumps(options)}"


def plugin_env(tmp_path, corruption: str) -> dict:
    """The corrupted backend as an installed plugin, found through its entry point."""
    plugin = corrupt_backend.write_entry_point(tmp_path / "plugin")
    module_folder = str(Path(corrupt_backend.__file__).parent)  # its entry point names it top-level
    path = os.pathsep.join([str(plugin), module_folder, str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path, "TITAN_PRIMUS_CORRUPT": corruption, "TITAN_PRIMUS_DISABLE_PLUGIN_AUTOLOAD": ""}


@pytest.mark.parametrize(
    "corruption, policy, caught_at, breach",
    [
        # wrong rows from step 3: interval 2 checks layer 0 at step 2 (clean), layer 1 at step 4
        (
            "rows:3",
            "stop",
            4,
            "layers.0.attention.wo (linear; corrupted, rowwise (torchao definition, e4m3fn)): "
            "out is not bit-identical to the emulation (32 of 256 rows differ",
        ),
        # a NaN from step 2: the every-step checks name the layer that made it (TorchTitan then stops on the loss)
        (
            "nan:2",
            "warn",
            2,
            "non-finite values made by layers.0.attention.qkv_linear.wqkv (call 1, backend corrupted): "
            "out non-finite from finite inputs",
        ),
    ],
)
def test_a_corrupted_plugin_backend_is_caught_on_the_first_checked_step(
    corruption, policy, caught_at, breach, tmp_path
):
    captures = tmp_path / "captures"
    losses, log = run_trainer(
        "llama3",
        "llama3_debugmodel",
        tmp_path / "run",
        5,
        *fp8(backend="corrupted", sentinel_interval=2, sentinel_policy=policy, sentinel_capture_folder=str(captures)),
        env=plugin_env(tmp_path, corruption),
        expect_failure=True,
    )
    assert "linears: 31 -> corrupted" in log
    assert breach in log, log[-3000:]
    assert int(re.findall(r"titan-primus sentinel: step (\d+): \d+ breach", log)[0]) == caught_at  # none before
    assert sorted(losses) == list(range(1, caught_at))  # stopped on the step it appeared
    if policy == "stop":
        assert (
            "step 2: layers.0.attention.qkv_linear.wqkv (corrupted, rowwise (torchao definition, e4m3fn)): "
            "bitwise equal to the emulation" in log
        )  # the checked step before the corruption
        assert "training stopped before the optimizer step" in log
        (capture,) = captures.glob("step0000004-rank0-layers.0.attention.wo-gemm1.pt")
        assert f"titan-primus parity --replay {capture}" in log
    else:
        assert "Loss is not finite" in log


def test_two_fsdp2_ranks_train_exactly_as_with_the_sentinel_off(tmp_path):
    """On: FP8 all-gather and full activation checkpointing too (the checked weights arrive FP8,
    the forward runs twice); off: neither (both are bit-exact, docs/measurements.md)."""
    fsdp2 = ("--parallelism.data_parallel_shard_degree", "2")
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}  # tests/support/full_activation_checkpointing.py
    on, log = run_trainer(
        "llama3",
        "llama3_debugmodel",
        tmp_path / "on",
        3,
        *fp8(recipe="tensorwise", enable_fsdp_float8_all_gather=True, sentinel_interval=1),
        "support.full_activation_checkpointing.full_ac",
        *fsdp2,
        nproc=2,
        env=env,
    )
    off, _ = run_trainer("llama3", "llama3_debugmodel", tmp_path / "off", 3, *fp8(recipe="tensorwise"), *fsdp2, nproc=2)
    assert on == off and sorted(on) == [1, 2, 3], (on, off)
    assert (
        "Applied FullAC activation checkpointing" in log
        and "FSDP2 all-gathers FP8 weights as FP8 payload + scales" in log
    )
    for step, layer in (
        (1, "layers.0.attention.qkv_linear.wqkv"),
        (2, "layers.0.attention.wo"),
        (3, "layers.0.feed_forward.w1"),
    ):
        assert (
            f"step {step}: {layer} (emulated, tensorwise (torchao definition, e4m3fn)): bitwise equal to the emulation"
            in log
        )
