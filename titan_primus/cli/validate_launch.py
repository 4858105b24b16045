"""The script ``titan-primus validate`` hands torchrun: TorchTitan 0.3's real trainer
(``torchtitan.train.main``; on a CPU through examples/cpu_launch.py), with two small hooks set
from the environment, and nothing else changed.

- ``TITAN_PRIMUS_VALIDATE_METRICS=PATH``: rank 0 appends one JSON line per logged step to PATH
  (loss, grad norm, tokens/s, peak memory) as the trainer hands them to its metric loggers
  (a wrapper around the logger ``MetricsProcessor`` builds), and one line with titan-primus's routing summary when the converter
  runs. The figures are the trainer's own; the console log is not parsed.
- ``TITAN_PRIMUS_VALIDATE_LAST_BIT=1``: once the trainer has initialised the model
  (``BaseModel.init_weights``), the lowest mantissa bit of every floating-point parameter is
  flipped: a numerically trivial change whose effect on the loss curve is the last-bit floor.

Run as a file (``torchrun .../validate_launch.py --module ... --config ...``); the arguments are
``torchtitan.train``'s. ``TITAN_PRIMUS_VALIDATE_CPU_LAUNCHER=PATH`` names the CPU launcher.
"""

import json
import os
import sys
from pathlib import Path

METRICS_ENV = "TITAN_PRIMUS_VALIDATE_METRICS"
LAST_BIT_ENV = "TITAN_PRIMUS_VALIDATE_LAST_BIT"
CPU_LAUNCHER_ENV = "TITAN_PRIMUS_VALIDATE_CPU_LAUNCHER"
_INT_VIEWS = {2: "int16", 4: "int32", 8: "int64"}


def _record(entry: dict) -> None:
    if os.environ.get("RANK", "0") != "0":
        return
    with open(os.environ[METRICS_ENV], "a") as f:
        f.write(json.dumps(entry) + "\n")


def flip_last_bit(model) -> int:
    """Flip the lowest mantissa bit of every floating-point parameter of ``model`` (each rank its
    own shard); returns how many elements changed."""
    import torch

    changed = 0
    with torch.no_grad():
        for param in model.parameters():
            local = getattr(param, "_local_tensor", param)  # a DTensor's shard
            if not local.is_floating_point() or local.numel() == 0:
                continue
            bits = local.view(getattr(torch, _INT_VIEWS[local.element_size()]))
            bits.bitwise_xor_(1)
            changed += local.numel()
    return changed


def _install_hooks() -> None:
    if os.environ.get(METRICS_ENV):
        from torchtitan.components.metrics import BaseLogger, MetricsProcessor

        class RecordingLogger(BaseLogger):
            """Records each training step's metrics, then hands them to the loggers the config chose."""

            def __init__(self, inner):
                self.inner = inner

            def log(self, metrics, step):
                if "loss_metrics/global_avg_loss" in metrics:
                    _record(
                        {
                            "step": int(step),
                            "loss": float(metrics["loss_metrics/global_avg_loss"]),
                            "grad_norm": float(metrics["grad_norm"]),
                            "tps": float(metrics["throughput(tps)"]),
                            "memory_bytes": int(metrics["memory/max_reserved(GiB)"] * 2**30),
                        }
                    )
                self.inner.log(metrics, step)

            def close(self):
                self.inner.close()

        build_metric_logger = MetricsProcessor._build_metric_logger

        def build_recording_logger(self, *args, **kwargs):
            return RecordingLogger(build_metric_logger(self, *args, **kwargs))

        MetricsProcessor._build_metric_logger = build_recording_logger

    if os.environ.get(METRICS_ENV) and "titan_primus" in sys.argv:  # the FP8 runs (--module titan_primus)
        from titan_primus.torchtitan.converter import Float8Converter

        convert = Float8Converter.convert

        def convert_and_record(self, model_config):
            converted = convert(self, model_config)
            _record({"routing": self.report.summary()})
            return converted

        Float8Converter.convert = convert_and_record

    if os.environ.get(LAST_BIT_ENV) == "1":
        from torchtitan.protocols.model import BaseModel

        init_weights = BaseModel.init_weights

        def init_weights_last_bit(self, *args, **kwargs):
            init_weights(self, *args, **kwargs)
            _record({"last_bit_flipped": flip_last_bit(self)})

        BaseModel.init_weights = init_weights_last_bit


def main() -> None:
    cpu_launcher = os.environ.get(CPU_LAUNCHER_ENV)
    if cpu_launcher:
        # Its device and attention workarounds must precede every other torchtitan import.
        sys.path.insert(0, str(Path(cpu_launcher).parent))
        import cpu_launch  # noqa: F401

    _install_hooks()
    from torchtitan.train import main as train

    code = train()
    if cpu_launcher:
        import cpu_world

        cpu_world.exit_without_teardown(code)


if __name__ == "__main__":
    main()
