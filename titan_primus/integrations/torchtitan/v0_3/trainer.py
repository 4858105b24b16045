"""TorchTitan 0.3's :class:`TrainerLine`: how ``titan-primus validate`` runs its trainer (``--module
M --config C``; FP8: ``--module titan_primus --config C_fp8[_RECIPE]``) and the hooks inside the
trainer process (seams.py holds the patches)."""

from __future__ import annotations

from pathlib import Path

from ..common.trainer import RunSpec, TrainerLine, common_args, record_routing
from . import seams

__all__ = ["LINE", "Line03"]

LAUNCHER = Path(__file__).resolve().parent / "launch.py"


class Line03(TrainerLine):
    name = "0.3"
    seams = seams
    cpu_launcher = LAUNCHER
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
        args += common_args(plan, seed, on_gpu, "--hf_assets_path", "--dataloader.dataset_path")
        return args + ["--validator.no-enable", "--dump_folder", str(dump)]

    def install_hooks(self, spec: RunSpec, record, flip_last_bit):
        if spec.fp8:  # --module titan_primus
            import dataclasses

            from .converter import Float8Converter

            options, init = spec.fp8_options, Float8Converter.__init__

            def init_with_options(self, config):
                init(self, dataclasses.replace(config, **options))

            Float8Converter.__init__ = init_with_options
            if spec.metrics:
                # convert() calls it, and the ready configs (config_registry.with_fp8) call it directly.
                record_routing(Float8Converter, "convert_model", record)
        if spec.metrics:
            self.record_step_metrics(record)
        if spec.last_bit:
            seams.record_initial_weights(lambda model: record({"last_bit_flipped": flip_last_bit(model)}))
        return self.train

    def train(self):
        from torchtitan.train import main

        return main()


LINE = Line03()
