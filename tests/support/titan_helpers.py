"""Helpers for tests that build TorchTitan 0.3 models or run its trainer on a CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from support.gemm_count import count_gemms
from support.trainer_run import torchrun_trainer

# The CPU launcher's attention swap (FlexAttention has no CPU backward), reused for models
# built in-process. Importing it also points TorchTitan's device helpers at the CPU.
# trainer_flags: the flags for a run's size and data on TorchTitan 0.3.0 or main (2026-08-21).
from titan_primus.integrations.torchtitan.common.debug_data import CORPUS, TOKENIZER  # noqa: E402
from titan_primus.integrations.torchtitan.v0_3.trainer import LAUNCHER  # noqa: E402
from titan_primus.integrations.torchtitan.v0_3.launch import TOKENS_1D, trainer_flags, use_causal_sdpa  # noqa: E402

MODEL_REGISTRIES = {
    "llama3": "torchtitan.models.llama3",
    "deepseek_v3": "torchtitan.models.deepseek_v3",
    "qwen3": "torchtitan.models.qwen3",
}


def print_line(text: str) -> None:
    """Print ``text`` as one line in one write. The ranks of a torchrun share one pipe, and under
    PYTHONUNBUFFERED print() writes a line's text and its newline separately, so two ranks'
    lines can interleave ("...: Truerank 1 ...")."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def print_every_rank(summary: dict) -> None:
    """Every rank's ``summary`` (its figures, JSON-able) gathered to rank 0, which prints them as one
    ``RESULT [...]`` line in rank order, each with its ``rank``: the test asserts each rank's, so a
    wrong result on any rank fails it (test_distributed.every_rank reads the line)."""
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, {"rank": dist.get_rank(), **summary})
    if dist.get_rank() == 0:
        print_line("RESULT " + json.dumps(every_rank, default=str))


def model_config(model: str, flavor: str = "debugmodel", converters=None):
    """A model config as ``model_registry`` builds it, with CPU-capable attention."""
    import importlib

    registry = importlib.import_module(MODEL_REGISTRIES[model]).model_registry
    config = registry(flavor, converters=converters).model
    use_causal_sdpa(config)
    return config


def token_ids(batch: int, seq_len: int, generator: torch.Generator | None = None, vocab: int = 2048) -> torch.Tensor:
    """Random token ids for a model's forward: ``(batch, seq_len)`` on TorchTitan 0.3.0, the same ids
    1-D on TorchTitan main (2026-08-21), whose models take ``[T]`` tokens (PR #4121)."""
    tokens = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    return tokens.flatten() if TOKENS_1D else tokens


def build(config, seed: int = 0):
    """Build on the meta device, materialise on the CPU and initialise, as the trainer does."""
    with torch.device("meta"):
        model = config.build()
    model.verify_module_protocol()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_states()
    return model


def run_trainer(
    module: str,
    config: str,
    dump: Path,
    steps: int,
    *extra: str,
    seq_len: int = 128,
    batch: int = 2,
    nproc: int = 1,
    env: dict | None = None,
    expect_failure: bool = False,
) -> tuple[dict[int, float], str]:
    """Run TorchTitan's real trainer through the CPU launcher (``nproc`` ranks, gloo), ``batch``
    sequences of ``seq_len`` tokens per rank and step; returns ({step: loss}, log)."""
    args = [
        "--module",
        module,
        "--config",
        config,
        "--hf_assets_path",
        str(TOKENIZER),
        *trainer_flags(seq_len, batch, CORPUS),
        "--training.steps",
        str(steps),
        "--dump_folder",
        str(dump),
        "--metrics.log_freq",
        "1",
        "--debug.seed",
        "42",
        "--validator.no-enable",
        *extra,
    ]
    return torchrun_trainer(LAUNCHER, args, nproc=nproc, env=env, expect_failure=expect_failure, timeout=900)


def convert(model="llama3", config=None, **options):
    """``model``'s debug config (or ``config``) through ``Float8Converter.Config(**options)``:
    (the converted config, the converter's report)."""
    from titan_primus.torchtitan import Float8Converter

    converter = Float8Converter.Config(**options).build()
    return converter.convert(config or model_config(model)), converter.report


def compile_blocks(model) -> None:
    """Each block of ``model`` compiled as TorchTitan's trainer compiles it, on one rank."""
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.distributed.parallel_dims import ParallelDims

    torch._dynamo.reset()
    single = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    apply_compile(model, compile_config=CompileConfig(enable=True), parallel_dims=single)


def gemms_per_step(config, ac, compiled: bool, ops, count=count_gemms, seq_len: int = 32) -> tuple[int, int]:
    """(FP8 GEMMs in the forward, in forward + backward) of one training step of ``config``
    built with activation checkpointing ``ac`` (a Config, or None); ``count(fn, ops, compiled)``
    returns ``(fn(), GEMMs it ran)``."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC  # noqa: F401  (TorchTitan's)

    model = build(config, seed=0)
    if ac is not None:
        ac.build().apply(model)
    tokens = token_ids(2, seq_len, torch.Generator().manual_seed(3))

    def step():
        out, forward = count(lambda: model(tokens), ops, compiled)
        _, backward = count(lambda: out.float().pow(2).mean().backward(), ops, compiled)
        return forward, forward + backward

    if compiled:
        compile_blocks(model)
        step()  # compiles (the counts of a step that compiles are not the kernels')
        model.zero_grad(set_to_none=True)
    return step()
