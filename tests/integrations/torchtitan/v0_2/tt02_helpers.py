"""Build TorchTitan 0.2.x debug models the way its trainer does, convert them, and run its
real trainer on a CPU."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import torch
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from support.repo_root import ROOT
from support.trainer_run import torchrun_trainer

from titan_primus.integrations.torchtitan.v0_2.trainer import LAUNCHER as LAUNCHER_02
from torchtitan.protocols.train_spec import get_train_spec

from titan_primus.conversion import ConversionOptions
from titan_primus.torchtitan02 import Float8Converter

MODELS = ["llama3", "deepseek_v3"]
EXAMPLES = ROOT / "examples" / "torchtitan02"


def meta_model(name: str, flavor: str = "debugmodel") -> torch.nn.Module:
    """The model as the trainer builds it before converters run: on the meta device, its args
    updated from a default job config (on a CPU, MoE experts then take the per-expert loop)."""
    spec = get_train_spec(name)
    args = copy.deepcopy(spec.model_args[flavor])
    args.update_from_config(JobConfig())
    with torch.device("meta"):
        return spec.model_cls(args)


def parallel_dims(world_size: int = 1, **degrees) -> ParallelDims:
    """TorchTitan's ParallelDims for ``degrees`` (tp=, ep=, ...); FSDP takes the rest."""
    dims = dict(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1) | degrees
    return ParallelDims(**dims, world_size=world_size)


def convert(
    model: torch.nn.Module, dims: ParallelDims | None = None, *, job: dict | None = None, **options
) -> Float8Converter:
    """Run the converter as TorchTitan does, with ``options`` as the [titan_primus] section;
    ``job``: other sections of the job config (e.g. ``{"model": SimpleNamespace(name=...)}``)."""
    job_config = SimpleNamespace(titan_primus=ConversionOptions(**options), **(job or {}))
    converter = Float8Converter(job_config, dims or parallel_dims())
    converter.convert(model)
    return converter


def materialize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Allocate on the CPU and initialise, as the trainer does after parallelising."""
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def tokens(vocab_size: int = 2048, batch: int = 2, seq: int = 64, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def stock_toml(fp8_toml: Path, directory: Path) -> Path:
    """The example config without the converter: TorchTitan's stock model, otherwise identical."""
    text = fp8_toml.read_text()
    assert 'converters = ["titan_primus.float8"]' in text
    path = directory / f"stock_{fp8_toml.name}"
    path.write_text(text.replace('converters = ["titan_primus.float8"]', "converters = []"))
    return path


def run_trainer(
    toml: Path,
    dump: Path,
    steps: int,
    *extra: str,
    seq_len: int = 128,
    nproc: int = 1,
    env: dict | None = None,
    expect_failure: bool = False,
) -> tuple[dict[int, float], str]:
    """TorchTitan 0.2's real trainer through the CPU launcher (``nproc`` ranks, gloo); returns
    ({step: loss}, log). ``env``: added to the environment."""
    args = [
        "--job.config_file",
        str(toml),
        "--training.steps",
        str(steps),
        "--training.seq_len",
        str(seq_len),
        "--training.local_batch_size",
        "2",
        "--job.dump_folder",
        str(dump),
        "--debug.seed",
        "42",
        *extra,
    ]
    return torchrun_trainer(LAUNCHER_02, args, nproc=nproc, env=env, expect_failure=expect_failure, timeout=600)


def parse(*args: str):
    """The deepseek_v3 debug job's TOML (with titan-primus's converter) and ``args``, as
    TorchTitan 0.2's ``ConfigManager`` parses them."""
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--job.config_file", str(EXAMPLES / "deepseek_v3_debug_fp8.toml"), *args])
