"""TorchTitan 0.2.2's real trainer on a CPU with the example TOML configs (examples/torchtitan02)."""

import re

import pytest
from support.closeness import assert_losses_within
from tt02_helpers import EXAMPLES, run_trainer, stock_toml

pytestmark = pytest.mark.trainer

LLAMA3 = EXAMPLES / "llama3_debug_fp8.toml"
DEEPSEEK_V3 = EXAMPLES / "deepseek_v3_debug_fp8.toml"


@pytest.mark.parametrize("toml, steps", [(LLAMA3, 6), (DEEPSEEK_V3, 4)], ids=["llama3", "deepseek_v3"])
def test_fp8_training_tracks_high_precision_and_learns(toml, steps, tmp_path):
    """Same seed, same data: the emulated-FP8 run's loss stays within 2% of the stock run's at
    every step, and falls (the bound the 0.3 suite uses)."""
    fp8, log = run_trainer(toml, tmp_path / "fp8", steps)
    ref, _ = run_trainer(stock_toml(toml, tmp_path), tmp_path / "ref", steps)
    assert sorted(fp8) == sorted(ref) == list(range(1, steps + 1))
    assert_losses_within(fp8, ref, 0.02)
    assert fp8[steps] < fp8[1] - 0.5
    assert "titan-primus FP8 routing on CPU" in log
    assert "linears: 43 -> emulated (rowwise (torchao definition, e4m3fn)" in log
    # TorchTitan 0.2.2 logs MFU for every run, its own float8 runs included.
    assert len(re.findall(r"mfu: [0-9.]+%", log)) == steps
    if toml is DEEPSEEK_V3:
        assert "grouped experts: 5 -> emulated" in log


def test_checkpoints_resume_across_high_precision_and_fp8(tmp_path):
    """A DCP checkpoint written by a stock run resumes under the converter, and the reverse."""
    dump, stock = tmp_path / "run", stock_toml(LLAMA3, tmp_path)
    ckpt = ("--checkpoint.enable", "--checkpoint.interval", "2")
    first, _ = run_trainer(stock, dump, 2, *ckpt)
    resumed, log = run_trainer(LLAMA3, dump, 4, *ckpt)
    assert "Loading the checkpoint" in log and "step-2" in log and "Training starts at step 3" in log
    assert sorted(resumed) == [3, 4] and "linears: 43 -> emulated" in log
    back, log = run_trainer(stock, dump, 5, *ckpt)
    assert "step-4" in log and "Training starts at step 5" in log
    assert sorted(back) == [5]
    assert back[5] < first[1] - 0.5  # resuming continues training, it does not restart it
