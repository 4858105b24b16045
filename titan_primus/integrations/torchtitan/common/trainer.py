"""What ``titan-primus validate`` does differently on each TorchTitan line (each line's
``trainer.py`` holds its :class:`TrainerLine`, chosen by the installed torchtitan version:
``titan_primus.integrations.torchtitan.trainer_line``); the runs, verdicts, JSON and report are
the same. This module: the part the lines share.

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
that holds the loss), and the FP8-only options (:attr:`RunSpec.fp8_options`) are set on the
converter's options as it is built, so the bf16 runs never see them. What validate tells a run is
one :class:`RunSpec`, in one environment variable.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType

from . import debug_data

__all__ = [
    "RUN_SPEC_ENV",
    "RunSpec",
    "TrainerLine",
    "common_args",
    "recording_logger",
    "record_routing",
]

RUN_SPEC_ENV = "TITAN_PRIMUS_VALIDATE_RUN"
METRIC_KEYS = {
    "loss": "loss_metrics/global_avg_loss",
    "grad_norm": "grad_norm",
    "tps": "throughput(tps)",
    "memory_gib": "memory/max_reserved(GiB)",
}


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """What ``titan-primus validate`` tells one trainer run (the torchrun child): one JSON object
    in one environment variable (:data:`RUN_SPEC_ENV`), which the run's recorded command shows.
    Outside validate there is none, and a run is TorchTitan's own."""

    metrics: str | None = None
    """The file each rank appends its records to, as JSON lines (the steps' metrics from the rank
    that holds the loss; the routing and the last-bit count from rank 0); None: nothing recorded."""
    fp8: bool = False
    """An FP8 run. TorchTitan 0.2.x: the job gets titan-primus's converter (the bf16 runs have it
    removed); 0.3: the run's config is already the FP8 one (``--module titan_primus``)."""
    fp8_options: dict = field(default_factory=dict)
    """Converter options of the FP8 runs only (ConversionOptions fields)."""
    last_bit: bool = False
    """Flip the lowest mantissa bit of every initial weight (the last-bit floor's run)."""
    cpu_launcher: str | None = None
    """The line's CPU launcher, imported before anything else of TorchTitan (a CPU run)."""

    def env(self) -> dict[str, str]:
        return {RUN_SPEC_ENV: json.dumps(asdict(self), sort_keys=True)}

    @classmethod
    def from_env(cls) -> RunSpec:
        spec = os.environ.get(RUN_SPEC_ENV)
        return cls(**json.loads(spec)) if spec else cls()


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

    seams: ModuleType
    """The line's seams.py."""

    def record_step_metrics(self, record) -> None:
        """Each logged step's metrics, as the trainer hands them to its metric loggers, to
        ``record`` (one dict per step, on TorchTitan's metrics rank: :func:`recording_logger`)."""
        from torchtitan.components.metrics import BaseLogger

        self.seams.record_metrics(recording_logger(BaseLogger, record))

    @abstractmethod
    def train(self) -> int:
        """Inside the trainer process: run the line's trainer as ``torchtitan.train`` does; its exit code."""
        ...

    @abstractmethod
    def install_hooks(self, spec: RunSpec, record, flip_last_bit):
        """Inside the trainer process: install the hooks ``spec`` asks for; returns the function
        that trains (its exit code)."""
        ...


def common_args(plan, seed: int, on_gpu: bool, tokenizer: str, dataset: str) -> list[str]:
    args = []
    if not on_gpu or "debug" in plan.config:  # the debug models train on the shipped tokenizer and corpus
        args += [tokenizer, str(debug_data.TOKENIZER), dataset, str(debug_data.CORPUS)]
    for flag, value in (("steps", plan.steps), ("seq_len", plan.seq_len), ("local_batch_size", plan.batch)):
        if value:
            args += [f"--training.{flag}", str(value)]
    return args + ["--debug.seed", str(seed), "--metrics.log_freq", "1", "--checkpoint.no-enable"]
