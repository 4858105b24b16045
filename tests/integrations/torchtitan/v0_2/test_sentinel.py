"""The numerics sentinel on TorchTitan 0.2.2: its options from TOML and the command line, the
converted modules watched (experts GEMM by GEMM) without changing a bit, and the real trainer
catching a corrupted backend installed as a plugin on the first checked step, layer named."""

import math
import os
import re
from pathlib import Path

from support import corrupt_backend
import pytest
import torch
from torchtitan.protocols.model_converter import build_model_converters
from tt02_helpers import parse
from tt02_helpers import EXAMPLES, ROOT, convert, materialize, meta_model, parallel_dims, run_trainer, tokens

from titan_primus import sentinel
from titan_primus.sentinel import WatchedBackend
from titan_primus.torchtitan02 import Fp8GroupedExperts, Fp8Linear


def test_options_come_from_the_toml_section_and_the_command_line():
    config = parse(
        "--titan_primus.sentinel_interval",
        "50",
        "--titan_primus.sentinel_policy",
        "stop",
        "--titan_primus.sentinel_capture_folder",
        "/tmp/breaches",
    )
    options = config.titan_primus.sentinel()
    assert (options.interval, options.policy, options.capture_folder) == (50, "stop", "/tmp/breaches")
    assert parse().titan_primus.sentinel() is None  # off by default


@pytest.mark.parametrize(
    "options, message",
    [
        ({"sentinel_interval": -3}, "'sentinel_interval' must be a whole number of steps >= 0"),
        ({"sentinel_interval": 5, "sentinel_policy": "abort"}, "'sentinel_policy' must be one of warn, stop"),
    ],
)
def test_bad_values_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        convert(meta_model("llama3"), **options)


def test_compile_with_the_sentinel_is_refused_before_the_first_step():
    config = parse("--compile.enable", "--titan_primus.sentinel_interval", "5")
    with pytest.raises(ValueError, match="does not run under torch.compile yet"):
        build_model_converters(config, parallel_dims())


def _step(model):
    out = model(tokens())
    out.float().pow(2).mean().backward()
    return out, [p.grad for p in model.parameters()]


def test_watched_modules_compute_the_same_bits_and_experts_are_checked_gemm_by_gemm():
    off = materialize(meta_model("deepseek_v3"))
    convert(off, device="cpu")
    on = meta_model("deepseek_v3")
    convert(on, device="cpu", sentinel_interval=1)
    materialize(on)
    fp8 = [m for m in on.modules() if isinstance(m, (Fp8Linear, Fp8GroupedExperts))]
    assert fp8 and all(isinstance(m.fp8_backend, WatchedBackend) for m in fp8)
    active = sentinel.active_sentinel()
    experts = next(layer for layer in active.layers if layer.name.endswith("moe.experts"))
    active.begin_step(experts.index + 1)
    out_on, grads_on = _step(on)
    report = active.finish_step()
    out_off, grads_off = _step(off)
    assert torch.equal(out_on, out_off) and all(torch.equal(a, b) for a, b in zip(grads_on, grads_off))
    assert report.checked_layer == experts.name and [c.record.gemm for c in report.checks] == [1, 2, 3]
    assert all(q.bitwise_equal for c in report.checks for q in c.quantities) and not report.breaches


def _plugin_env(tmp_path, corruption: str) -> dict:
    plugin = corrupt_backend.write_entry_point(tmp_path / "plugin")
    module_folder = str(Path(corrupt_backend.__file__).parent)  # its entry point names it top-level
    path = os.pathsep.join([str(plugin), module_folder, str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path, "TITAN_PRIMUS_CORRUPT": corruption, "TITAN_PRIMUS_DISABLE_PLUGIN_AUTOLOAD": ""}


@pytest.mark.trainer
@pytest.mark.parametrize(
    "corruption, policy, caught_at, breach",
    [
        # wrong rows from step 3: interval 2 checks layer 0 at step 2 (clean), layer 1 at step 4
        (
            "rows:3",
            "stop",
            4,
            "layers.0.attention.wk (linear; corrupted, rowwise (torchao definition, e4m3fn)): "
            "out is not bit-identical to the emulation (32 of 256 rows differ",
        ),
        # a NaN from step 2: the every-step checks name the layer that made it, on that step
        (
            "nan:2",
            "warn",
            2,
            "non-finite values made by layers.0.attention.wq (call 1, backend corrupted): "
            "out non-finite from finite inputs",
        ),
    ],
)
def test_a_corrupted_plugin_backend_is_caught_on_the_first_checked_step(
    corruption, policy, caught_at, breach, tmp_path
):
    captures = tmp_path / "captures"
    losses, log = run_trainer(
        EXAMPLES / "llama3_debug_fp8.toml",
        tmp_path / "run",
        4 if policy == "warn" else 5,
        "--titan_primus.backend",
        "corrupted",
        "--titan_primus.sentinel_interval",
        "2",
        "--titan_primus.sentinel_policy",
        policy,
        "--titan_primus.sentinel_capture_folder",
        str(captures),
        env=_plugin_env(tmp_path, corruption),
        expect_failure=policy == "stop",
    )
    assert "linears: 43 -> corrupted" in log
    assert breach in log, log[-3000:]
    assert int(re.findall(r"titan-primus sentinel: step (\d+): \d+ breach", log)[0]) == caught_at  # none before
    if policy == "stop":
        assert "step 2: layers.0.attention.wq (corrupted, rowwise (torchao definition, e4m3fn)): bitwise equal" in log
        assert sorted(losses) == [1, 2, 3] and "training stopped before the optimizer step" in log
        (capture,) = captures.glob("step0000004-rank0-layers.0.attention.wk-gemm1.pt")
    else:
        # TorchTitan 0.2 trains on through a NaN loss (steps 2-4); the sentinel said where it came from
        assert sorted(losses) == [1, 2, 3, 4]
        assert [step for step, loss in sorted(losses.items()) if math.isnan(loss)] == [2, 3, 4]
