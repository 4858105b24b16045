"""What ``titan-primus validate`` does differently on each TorchTitan line, chosen by the installed
torchtitan version (:func:`trainer_line`); the runs, verdicts, JSON and report are the same.

Per line: the configs of the CPU defaults, the trainer arguments of a run (how the FP8 runs get
the converter), the CPU launcher, and, inside the trainer process (launch.py), where the
per-step metrics are captured, where the converter's routing summary is read, where the initial
weights get their last-bit flip, and how the trainer is started.

- 0.3: ``--module M --config C`` (FP8: ``--module titan_primus --config C_fp8[_RECIPE]``); the
  metric logger ``MetricsProcessor._build_metric_logger`` builds; ``BaseModel.init_weights``.
- 0.2.x: ``--job.config_file TOML`` (FP8: titan-primus's converter added to ``model.converters``,
  ``--titan_primus.recipe``; bf16: it is removed); the logger ``metrics._build_metric_logger``
  builds; the model parts once ``Trainer.__init__`` has initialised them.

On both lines the steps are recorded on the rank TorchTitan itself logs metrics from
(``_get_metrics_rank``: under pipeline parallelism the first rank of the last stage, the one
that holds the loss), and the FP8-only options (``FP8_OPTIONS_ENV``) are set on the converter's
options as it is built, so the bf16 runs never see them.
"""

from __future__ import annotations

import json
import os
import tomllib
from abc import ABC, abstractmethod
from pathlib import Path

from ... import cpu_trainer

__all__ = ["FP8_OPTIONS_ENV", "Line02", "Line03", "TrainerLine", "trainer_line"]

# The clone this package runs from, when it runs from one: a relative 0.2.x --config that is not
# under the working directory is looked up there, so the CPU defaults (example TOMLs of the
# clone, examples/torchtitan02) resolve from any directory. An installed wheel has no examples/:
# there the 0.2.x defaults are refused as missing, and --config names the job's TOML.
CLONE_ROOT = Path(__file__).resolve().parents[3]
# On 0.2.x, whether a run trains with titan-primus's converter (set by validate for every run).
CONVERTER_ENV = "TITAN_PRIMUS_VALIDATE_CONVERTER"
# The converter options of the FP8 runs only (a JSON object of ConversionOptions fields).
FP8_OPTIONS_ENV = "TITAN_PRIMUS_VALIDATE_FP8_OPTIONS"
METRIC_KEYS = {
    "loss": "loss_metrics/global_avg_loss",
    "grad_norm": "grad_norm",
    "tps": "throughput(tps)",
    "memory_gib": "memory/max_reserved(GiB)",
}


def fp8_options() -> dict:
    """The FP8-only converter options validate handed this run (empty for the bf16 runs)."""
    return json.loads(os.environ.get(FP8_OPTIONS_ENV) or "{}")


def recording_logger(base_logger_cls, record):
    """A metric logger class that records each training step's metrics (the trainer's own figures,
    the same keys on both lines) on the rank that holds the loss (``records``), then hands them to
    the loggers the config chose."""

    class RecordingLogger(base_logger_cls):
        def __init__(self, inner, records: bool):
            self.inner, self.records = inner, records

        def log(self, metrics, step):
            if self.records and METRIC_KEYS["loss"] in metrics:
                record(
                    {
                        "step": int(step),
                        "loss": float(metrics[METRIC_KEYS["loss"]]),
                        "grad_norm": float(metrics[METRIC_KEYS["grad_norm"]]),
                        "tps": float(metrics[METRIC_KEYS["tps"]]),
                        "memory_bytes": int(metrics[METRIC_KEYS["memory_gib"]] * 2**30),
                    }
                )
            self.inner.log(metrics, step)

        def close(self):
            self.inner.close()

    return RecordingLogger


def record_routing(converter_cls, method: str, record) -> None:
    """After each conversion (``converter_cls.method``), record the converter's routing summary
    and its data (the FP8-engaged verdict reads it)."""
    convert = getattr(converter_cls, method)

    def convert_and_record(self, *args, **kwargs):
        converted = convert(self, *args, **kwargs)
        record({"routing": self.report.summary(), "routing_data": self.report.as_dict()})
        return converted

    setattr(converter_cls, method, convert_and_record)


class TrainerLine(ABC):
    """The line-specific pieces; each TorchTitan line's subclass implements the abstract ones."""

    name: str
    cpu_launcher: Path
    # CPU defaults: (stock model, config, steps); measured in docs/measurements.md.
    cpu_default: list[tuple[str, str, int]]
    cpu_quick: list[tuple[str, str, int]]

    config_example: str

    @abstractmethod
    def fp8_config(self, plan) -> str: ...

    def run_names(self, plan, fp8: bool) -> tuple[str, str]:
        """The module and config a run records."""
        return plan.module, plan.fp8_config if fp8 else plan.config

    @abstractmethod
    def check_plan(self, module: str | None, config: str) -> str:
        """The model name of ``config`` (``module`` where the line needs it), or ValueError."""
        ...

    @abstractmethod
    def trainer_args(self, plan, fp8: bool, seed: int, dump: Path, on_gpu: bool) -> list[str]: ...

    def run_env(self, fp8: bool) -> dict[str, str]:
        return {}

    @abstractmethod
    def install_hooks(self, record, flip_last_bit, metrics: bool, last_bit: bool):
        """Inside the trainer process: install the hooks; returns the function that trains (its
        exit code)."""
        ...


def _common_args(plan, seed: int, on_gpu: bool, tokenizer: str, dataset: str) -> list[str]:
    args = []
    if not on_gpu or "debug" in plan.config:  # the debug models train on the shipped tokenizer and corpus
        args += [tokenizer, str(cpu_trainer.TOKENIZER), dataset, str(cpu_trainer.CORPUS)]
    for flag, value in (("steps", plan.steps), ("seq_len", plan.seq_len), ("local_batch_size", plan.batch)):
        if value:
            args += [f"--training.{flag}", str(value)]
    return args + ["--debug.seed", str(seed), "--metrics.log_freq", "1", "--checkpoint.no-enable"]


class Line03(TrainerLine):
    name = "0.3"
    cpu_launcher = cpu_trainer.LAUNCHER
    cpu_default = [("llama3", "llama3_debugmodel", 200), ("deepseek_v3", "deepseek_v3_debugmodel", 50)]
    cpu_quick = [("llama3", "llama3_debugmodel", 20)]
    config_example = "--module llama3 --config llama3_8b"

    def fp8_config(self, plan) -> str:
        return f"{plan.config}_fp8" + ("" if plan.recipe == "rowwise" else f"_{plan.recipe}")

    def run_names(self, plan, fp8):
        return ("titan_primus" if fp8 else plan.module), (self.fp8_config(plan) if fp8 else plan.config)

    def check_plan(self, module, config):
        if not module:
            raise ValueError("--config needs --module (the stock TorchTitan model, e.g. --module llama3)")
        return module

    def trainer_args(self, plan, fp8, seed, dump, on_gpu):
        args = [
            "--module",
            "titan_primus" if fp8 else plan.module,
            "--config",
            self.fp8_config(plan) if fp8 else plan.config,
        ]
        args += _common_args(plan, seed, on_gpu, "--hf_assets_path", "--dataloader.dataset_path")
        return args + ["--validator.no-enable", "--dump_folder", str(dump)]

    def install_hooks(self, record, flip_last_bit, metrics, last_bit):
        import sys

        if "titan_primus" in sys.argv:  # the FP8 runs (--module titan_primus)
            import dataclasses

            from titan_primus.torchtitan.converter import Float8Converter

            options, init = fp8_options(), Float8Converter.__init__

            def init_with_options(self, config):
                init(self, dataclasses.replace(config, **options))

            Float8Converter.__init__ = init_with_options
            if metrics:
                # convert() calls it, and the ready configs (config_registry.with_fp8) call it directly.
                record_routing(Float8Converter, "convert_model", record)
        if metrics:
            import torch.distributed as dist
            from torchtitan.components.metrics import BaseLogger, MetricsProcessor, _get_metrics_rank

            logger_cls = recording_logger(BaseLogger, record)
            build_metric_logger = MetricsProcessor._build_metric_logger

            def build_recording_logger(self, *args, **kwargs):
                rank = _get_metrics_rank(parallel_dims=kwargs["parallel_dims"], pp_schedule=kwargs["pp_schedule"])
                return logger_cls(build_metric_logger(self, *args, **kwargs), dist.get_rank() == rank)

            MetricsProcessor._build_metric_logger = build_recording_logger
        if last_bit:
            from torchtitan.protocols.model import BaseModel

            init_weights = BaseModel.init_weights

            def init_weights_last_bit(self, *args, **kwargs):
                init_weights(self, *args, **kwargs)
                record({"last_bit_flipped": flip_last_bit(self)})

            BaseModel.init_weights = init_weights_last_bit
        from torchtitan.train import main

        return main


class Line02(TrainerLine):
    name = "0.2.x"
    cpu_launcher = cpu_trainer.LAUNCHER_02
    cpu_default = [
        ("llama3", "examples/torchtitan02/llama3_debug_fp8.toml", 200),
        ("deepseek_v3", "examples/torchtitan02/deepseek_v3_debug_fp8.toml", 50),
    ]
    cpu_quick = [("llama3", "examples/torchtitan02/llama3_debug_fp8.toml", 20)]
    config_example = "--config job.toml (the job's TOML file)"
    CONVERTER = "titan_primus.float8"
    ADAPTER = "titan_primus.torchtitan02"

    def fp8_config(self, plan) -> str:
        return plan.config  # the same TOML; the converter is added to model.converters

    def _toml(self, config: str) -> Path:
        path = Path(config)
        return path.resolve() if path.is_absolute() or path.exists() else CLONE_ROOT / path

    def check_plan(self, module, config):
        path = self._toml(config)
        if not config.endswith(".toml") or not path.is_file():
            raise ValueError(
                f"--config {config}: on TorchTitan 0.2.x, --config is the job's TOML file "
                "(e.g. examples/torchtitan02/llama3_debug_fp8.toml); it does not exist here"
            )
        with path.open("rb") as f:
            name = tomllib.load(f).get("model", {}).get("name")
        if module and name and module != name:
            raise ValueError(f"--module {module}: {config} trains model {name!r}; drop --module or make them agree")
        return name or module or "unknown"

    def trainer_args(self, plan, fp8, seed, dump, on_gpu):
        # The adapter's config section and converter registry, in every run (the bf16 runs of a
        # titan-primus TOML need its [titan_primus] section parsed); the converter only in FP8 runs.
        args = ["--job.config_file", str(self._toml(plan.config)), "--job.custom_config_module", self.ADAPTER]
        args += ["--experimental.custom_import", self.ADAPTER]
        if fp8:
            args += ["--titan_primus.recipe", plan.recipe]
        args += _common_args(plan, seed, on_gpu, "--model.hf_assets_path", "--training.dataset_path")
        return args + ["--validation.no-enable", "--job.dump_folder", str(dump)]

    def run_env(self, fp8):
        return {CONVERTER_ENV: "on" if fp8 else "off"}

    def install_hooks(self, record, flip_last_bit, metrics, last_bit):
        import torchtitan.components.metrics as tt_metrics
        from torchtitan.config import ConfigManager
        from torchtitan.train import Trainer, main

        # TorchTitan 0.2's command line cannot empty a list (model.converters), so the converter
        # is added or removed once the config is parsed; the user's other converters stay.
        parse_args, fp8 = ConfigManager.parse_args, os.environ.get(CONVERTER_ENV) == "on"

        def parse_args_with_converter(self, *args, **kwargs):
            config = parse_args(self, *args, **kwargs)
            converters = [c for c in config.model.converters if c != Line02.CONVERTER]
            config.model.converters = [*converters, Line02.CONVERTER] if fp8 else converters
            return config

        ConfigManager.parse_args = parse_args_with_converter
        if fp8:
            from titan_primus.torchtitan02.converter import Float8Converter

            options, init = fp8_options(), Float8Converter.__init__

            def init_with_options(self, job_config, parallel_dims):
                for name, value in options.items():
                    setattr(job_config.titan_primus, name, value)
                init(self, job_config, parallel_dims)

            Float8Converter.__init__ = init_with_options
            if metrics:
                record_routing(Float8Converter, "convert", record)
        if metrics:
            import torch.distributed as dist

            logger_cls = recording_logger(tt_metrics.BaseLogger, record)
            build_metric_logger = tt_metrics._build_metric_logger  # MetricsProcessor.__init__ calls it by name

            def build_recording_logger(job_config, parallel_dims, *args, **kwargs):
                records = dist.get_rank() == tt_metrics._get_metrics_rank(parallel_dims, job_config)
                return logger_cls(build_metric_logger(job_config, parallel_dims, *args, **kwargs), records)

            tt_metrics._build_metric_logger = build_recording_logger
        trainer_cls = Trainer
        if last_bit:

            class LastBitTrainer(Trainer):
                """Trainer.__init__ initialises the model parts (init_weights) and loads nothing
                before train(): the flip follows it."""

                def __init__(self, job_config):
                    super().__init__(job_config)
                    record({"last_bit_flipped": sum(flip_last_bit(m) for m in self.model_parts)})

            trainer_cls = LastBitTrainer
        return lambda: main(trainer_cls)


def trainer_line() -> TrainerLine:
    """The line of the installed torchtitan, or ValueError naming the fix."""
    from ...adapter_import import installed_version

    version = installed_version("torchtitan")
    if version and version.startswith("0.3"):
        return Line03()
    if version and version.startswith("0.2"):
        return Line02()
    raise ValueError(
        f"validate drives TorchTitan 0.3's or 0.2.x's trainer; this environment has torchtitan "
        f"{version or 'not installed'} (pip install 'titan-primus[torchtitan]' or 'titan-primus[torchtitan02]')"
    )
