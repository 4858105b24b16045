"""TorchTitan's real trainer (torchrun, CPU launcher) with ``--module titan_primus``."""

import re

import pytest
from support.closeness import assert_losses_within
from support.titan_helpers import run_trainer

pytestmark = pytest.mark.trainer

MFU = re.compile(r"mfu: (N/A|[0-9.]+%)")


def test_fp8_training_tracks_bf16_and_learns(tmp_path):
    """Same seed, same data: the emulated-FP8 run's loss stays within 2% of the high-precision
    run's at every step, and falls. Measured over 10 steps at seq 256: at most 0.1% (llama3) and
    0.6% (deepseek_v3 MoE); rowwise FP8 is ~28 dB per GEMM (~4% elementwise noise), which
    averages out in the loss and grows slowly with steps. 2% leaves margin for other seeds."""
    fp8, log = run_trainer("titan_primus", "llama3_debugmodel_fp8", tmp_path / "fp8", 6)
    ref, ref_log = run_trainer("llama3", "llama3_debugmodel", tmp_path / "ref", 6)
    assert sorted(fp8) == sorted(ref) == list(range(1, 7))
    assert_losses_within(fp8, ref, 0.02)
    assert fp8[6] < fp8[1] - 0.5
    assert "titan-primus FP8 routing on CPU" in log
    assert "linears: 31 -> emulated (rowwise (torchao definition, e4m3fn)" in log
    # The config registry's selective activation checkpointing saves the FP8 GEMMs' outputs.
    assert "Applied Fp8SelectiveAC activation checkpointing" in log
    assert "Applied SelectiveAC activation checkpointing" in ref_log
    # TorchTitan knows the run is quantized: no MFU against the bf16 peak, as for its own FP8 runs.
    assert len(MFU.findall(log)) == 6 and set(MFU.findall(log)) == {"N/A"}
    assert len(MFU.findall(ref_log)) == 6 and "N/A" not in MFU.findall(ref_log)


@pytest.mark.parametrize(
    "model, bf16_config, fp8_config",
    [
        # deepseek_v3's expert weights: tests/integrations/torchtitan/v0_3/test_converter.py round-trips its DCP checkpoints.
        ("llama3", "llama3_debugmodel", "llama3_debugmodel_fp8"),
    ],
)
def test_checkpoints_resume_across_bf16_and_fp8(model, bf16_config, fp8_config, tmp_path):
    """A DCP checkpoint written by a bf16 run resumes under the converter, and the reverse."""
    dump = tmp_path / "run"
    ckpt = ("--checkpoint.enable", "--checkpoint.interval", "2")
    first, _ = run_trainer(model, bf16_config, dump, 2, *ckpt)
    resumed, log = run_trainer("titan_primus", fp8_config, dump, 4, *ckpt)
    assert "Loading the checkpoint from" in log and "step-2" in log and "Training starts at step 3" in log
    assert sorted(resumed) == [3, 4]
    back, log = run_trainer(model, bf16_config, dump, 5, *ckpt)
    assert "step-4" in log and "Training starts at step 5" in log
    assert sorted(back) == [5]
    # Resuming continues training, it does not restart it.
    assert back[5] < first[1] - 0.5


def test_override_route_on_a_stock_config(tmp_path):
    losses, log = run_trainer(
        "llama3",
        "llama3_debugmodel",
        tmp_path / "ovr",
        2,
        "--override.imports",
        'titan_primus.torchtitan.overrides.fp8={"recipe": "tensorwise"}',
        "titan_primus.torchtitan.overrides.fp8_selective_ac",
    )
    assert "recipe tensorwise" in log and "linears: 31 -> emulated" in log
    assert "Applied Fp8SelectiveAC activation checkpointing" in log
    assert len(losses) == 2
