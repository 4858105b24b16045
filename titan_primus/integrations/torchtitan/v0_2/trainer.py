"""TorchTitan 0.2.x's :class:`TrainerLine`: how ``titan-primus validate`` runs its trainer
(``--job.config_file TOML``; FP8: titan-primus's converter added to ``model.converters`` and
``--titan_primus.recipe``; bf16: it is removed) and the hooks inside the trainer process (seams.py
holds the patches)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from ..common.trainer import RunSpec, TrainerLine, common_args, record_routing
from . import seams

__all__ = ["LINE", "Line02"]

_HERE = Path(__file__).resolve().parent
LAUNCHER = _HERE / "launch.py"
# The debug models' TOMLs ship with the package; a clone links them as examples/torchtitan02/, the
# names the CPU defaults and the docs use, which resolve to the shipped files from any directory.
SHIPPED_CONFIGS = _HERE / "configs"
EXAMPLES = Path("examples/torchtitan02")


class Line02(TrainerLine):
    name = "0.2.x"
    seams = seams
    cpu_launcher = LAUNCHER
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
        if path.is_absolute() or path.exists():
            return path.absolute()
        shipped = SHIPPED_CONFIGS / path.name
        return shipped if path.parent == EXAMPLES and shipped.is_file() else path.absolute()

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
        args += common_args(plan, seed, on_gpu, "--model.hf_assets_path", "--training.dataset_path")
        return args + ["--validation.no-enable", "--job.dump_folder", str(dump)]

    def install_hooks(self, spec: RunSpec, record, flip_last_bit):
        from torchtitan.train import Trainer, main

        # TorchTitan 0.2's command line cannot empty a list (model.converters), so the converter
        # is added or removed once the config is parsed; the user's other converters stay.
        fp8 = spec.fp8

        def with_converter(config):
            converters = [c for c in config.model.converters if c != Line02.CONVERTER]
            config.model.converters = [*converters, Line02.CONVERTER] if fp8 else converters
            return config

        seams.edit_parsed_config(with_converter)
        if fp8:
            from .converter import Float8Converter

            options, init = spec.fp8_options, Float8Converter.__init__

            def init_with_options(self, job_config, parallel_dims):
                for name, value in options.items():
                    setattr(job_config.titan_primus, name, value)
                init(self, job_config, parallel_dims)

            Float8Converter.__init__ = init_with_options
            if spec.metrics:
                record_routing(Float8Converter, "convert", record)
        if spec.metrics:
            self.record_step_metrics(record)
        trainer_cls = Trainer
        if spec.last_bit:

            class LastBitTrainer(Trainer):
                """Trainer.__init__ initialises the model parts (init_weights) and loads nothing
                before train(): the flip follows it."""

                def __init__(self, job_config):
                    super().__init__(job_config)
                    record({"last_bit_flipped": sum(flip_last_bit(m) for m in self.model_parts)})

            trainer_cls = LastBitTrainer
        return lambda: main(trainer_cls)

    def train(self):
        from torchtitan.train import Trainer, main

        return main(Trainer)


LINE = Line02()
