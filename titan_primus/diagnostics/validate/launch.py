"""The script ``titan-primus validate`` hands torchrun: TorchTitan's real trainer
(``torchtitan.train``, 0.3 or 0.2.x; on a CPU through the line's CPU launcher), with the small
hooks its :class:`~titan_primus.integrations.torchtitan.common.trainer.RunSpec` asks for, and
nothing else changed. Where each hook sits on each line: the lines' ``trainer.py``.

- ``metrics``: the rank that holds the loss (TorchTitan's metrics rank: under pipeline
  parallelism the last stage's) appends one JSON line per logged step to the file (loss, grad
  norm, tokens/s, peak memory) as the trainer hands them to its metric loggers (a wrapper around
  the logger ``MetricsProcessor`` builds), and rank 0 one line with titan-primus's routing summary
  and data when the converter runs. The figures are the trainer's own; the console log is not
  parsed.
- ``last_bit``: once the trainer has initialised the model, the lowest mantissa bit of every
  floating-point parameter is flipped: a numerically trivial change whose effect on the loss curve
  is the last-bit floor.
- ``cpu_launcher``: imported first, on a CPU.

Run as a file (``torchrun .../validate/launch.py ARGS``); the arguments are ``torchtitan.train``'s.
"""

import importlib
import json
import os
from pathlib import Path

import titan_primus
from titan_primus.integrations.torchtitan.common.trainer import RunSpec

_INT_VIEWS = {2: "int16", 4: "int32", 8: "int64"}


def _recorder(path: str | None):
    def record(entry: dict) -> None:
        # Steps come from the one rank whose logger records them; everything else from rank 0.
        if "step" not in entry and os.environ.get("RANK", "0") != "0":
            return
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")

    return record


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


def main() -> None:
    spec = RunSpec.from_env()
    cpu_launcher = spec.cpu_launcher
    if cpu_launcher:
        # Its device and attention workarounds must precede every other torchtitan import (a
        # launcher is a module of the package: titan_primus/integrations/torchtitan/<line>/launch.py).
        package_root = Path(titan_primus.__file__).resolve().parent.parent
        importlib.import_module(".".join(Path(cpu_launcher).resolve().relative_to(package_root).with_suffix("").parts))

    from titan_primus.integrations.torchtitan import trainer_line

    line = trainer_line()
    train = line.install_hooks(spec, _recorder(spec.metrics), flip_last_bit)
    code = train()
    if cpu_launcher:
        from titan_primus.integrations.torchtitan.common.cpu_world import exit_without_teardown

        exit_without_teardown(code)


if __name__ == "__main__":
    main()
