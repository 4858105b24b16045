"""Selective per-op activation checkpointing keeps the FP8 GEMMs on TorchTitan 0.2.x: the
converter adds every backend's ``fp8_gemm_ops`` to the model's ``_op_sac_save_list`` (what its
parallelize function hands to ``apply_ac``), so a checkpointed training step runs three FP8 GEMMs
per op, as without checkpointing."""

import sys
from types import SimpleNamespace

import pytest
import torch
from torchtitan.config.job_config import ActivationCheckpoint
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.protocols.train_spec import get_train_spec
from tt02_helpers import materialize, meta_model, parallel_dims, tokens

from support.gemm_count import count_gemms

import titan_primus as tp
from titan_primus.checkpointing import fp8_gemm_save_ops
from titan_primus.conversion import ConversionOptions
from titan_primus.torchtitan02 import Float8Converter


def save_list(model_name: str) -> set:
    parallelize = get_train_spec(model_name).parallelize_fn
    return sys.modules[parallelize.__module__]._op_sac_save_list


def converted(model_name: str, **options):
    model = meta_model(model_name)
    job_config = SimpleNamespace(titan_primus=ConversionOptions(**options), model=SimpleNamespace(name=model_name))
    Float8Converter(job_config, parallel_dims()).convert(model)
    return materialize(model)


@pytest.mark.parametrize("model_name", ["llama3", "deepseek_v3"])
def test_converter_adds_the_fp8_gemm_ops_to_the_models_save_list(model_name):
    converted(model_name)
    assert fp8_gemm_save_ops() <= save_list(model_name)
    assert torch.ops.aten._scaled_mm.default in save_list(model_name)  # 0.2.2's lists hold aten.mm only
    assert torch.ops.titan_primus.emulated_fp8_mm.default in save_list(model_name)


def gemms_per_step(model, ops, ac_save_list) -> tuple[int, int]:
    if ac_save_list is not None:
        apply_ac(model, ActivationCheckpoint(mode="selective", selective_ac_option="op"), op_sac_save_list=ac_save_list)
    batch = tokens(seq=32)
    out, forward = count_gemms(lambda: model(batch), ops)
    _, backward = count_gemms(lambda: out.float().pow(2).mean().backward(), ops)
    return forward, forward + backward


@pytest.mark.parametrize(
    "model_name, backend, recipe",
    [
        ("llama3", "emulated", "rowwise"),
        ("deepseek_v3", "emulated", "rowwise"),
        ("llama3", "torchao", "tensorwise"),
    ],
)
def test_selective_op_ac_runs_three_fp8_gemms_per_op(model_name, backend, recipe):
    """Eager, one step of the debug model: FP8 GEMMs without checkpointing, with 0.2.2's selective
    op policy on its stock save list, and on the list the converter extended. Measured
    (2026-12-01; llama3: 43 FP8 linears, 42 in checkpointed blocks; deepseek_v3: 58 FP8 linears
    and grouped GEMMs): emulated llama3 129 / 171 / 129, deepseek_v3 174 / 231 / 174; TorchAO
    llama3 129 / 171 / 129 (its forward GEMM reaches the policy as aten._scaled_mm, absent from
    0.2.2's lists)."""
    ops = tp.registry.get_backend(backend).fp8_gemm_ops()
    options = dict(backend=backend, recipe=recipe)
    forward, plain = gemms_per_step(converted(model_name, **options), ops, None)
    stock = save_list(model_name) - fp8_gemm_save_ops()
    _, before = gemms_per_step(converted(model_name, **options), ops, stock)
    _, after = gemms_per_step(converted(model_name, **options), ops, save_list(model_name))
    assert forward > 0 and plain == 3 * forward, (forward, plain)
    assert after == plain, (plain, before, after)
    assert before > plain, (plain, before, after)


def test_toml_path_keeps_the_gemms_through_the_models_parallelize_function():
    """The 0.2.x way in end to end: the example TOML (converter, ``[titan_primus]`` section) with
    selective op checkpointing, converted by TorchTitan's converter container and parallelised by
    the train spec's own ``parallelize_fn`` (which hands ``apply_ac`` its module's save list):
    three FP8 GEMMs per op in a step (the stock list: 129 / 171)."""
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.model_converter import build_model_converters
    from tt02_helpers import EXAMPLES

    job_config = ConfigManager().parse_args(
        [
            "--job.config_file",
            str(EXAMPLES / "llama3_debug_fp8.toml"),
            "--titan_primus.backend",
            "emulated",
            "--activation_checkpoint.selective_ac_option",
            "op",
            "--training.seq_len",
            "32",
        ]
    )
    dims = parallel_dims()
    model = meta_model("llama3")
    build_model_converters(job_config, dims).convert(model)
    get_train_spec("llama3").parallelize_fn(model, dims, job_config)
    ops = tp.registry.get_backend("emulated").fp8_gemm_ops()
    forward, step = gemms_per_step(materialize(model), ops, None)
    assert forward == 43 and step == 3 * forward, (forward, step)
