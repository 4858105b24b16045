"""The script ``titan-primus validate`` hands torchrun: TorchTitan's real trainer
(``torchtitan.train``, 0.3 or 0.2.x; on a CPU through the line's CPU launcher), with two small hooks
set from the environment, and nothing else changed. Where each hook sits on each line:
lines.py.

- ``TITAN_PRIMUS_VALIDATE_METRICS=PATH``: the rank that holds the loss (TorchTitan's metrics
  rank: under pipeline parallelism the last stage's) appends one JSON line per logged step to
  PATH (loss, grad norm, tokens/s, peak memory) as the trainer hands them to its metric loggers
  (a wrapper around the logger ``MetricsProcessor`` builds), and rank 0 one line with
  titan-primus's routing summary and data when the converter runs. The figures are the trainer's own; the console log is
  not parsed.
- ``TITAN_PRIMUS_VALIDATE_LAST_BIT=1``: once the trainer has initialised the model, the lowest
  mantissa bit of every floating-point parameter is flipped: a numerically trivial change whose
  effect on the loss curve is the last-bit floor.

Run as a file (``torchrun .../validate/launch.py ARGS``); the arguments are ``torchtitan.train``'s.
``TITAN_PRIMUS_VALIDATE_CPU_LAUNCHER=PATH`` names the CPU launcher.
"""

import importlib
import json
import os
from pathlib import Path

import titan_primus

METRICS_ENV = "TITAN_PRIMUS_VALIDATE_METRICS"
LAST_BIT_ENV = "TITAN_PRIMUS_VALIDATE_LAST_BIT"
CPU_LAUNCHER_ENV = "TITAN_PRIMUS_VALIDATE_CPU_LAUNCHER"
_INT_VIEWS = {2: "int16", 4: "int32", 8: "int64"}


def _record(entry: dict) -> None:
    # Steps come from the one rank whose logger records them; everything else from rank 0.
    if "step" not in entry and os.environ.get("RANK", "0") != "0":
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


def main() -> None:
    cpu_launcher = os.environ.get(CPU_LAUNCHER_ENV)
    if cpu_launcher:
        # Its device and attention workarounds must precede every other torchtitan import (a
        # launcher is a module of the package: titan_primus/integrations/torchtitan/<line>/launch.py).
        package_root = Path(titan_primus.__file__).resolve().parent.parent
        importlib.import_module(".".join(Path(cpu_launcher).resolve().relative_to(package_root).with_suffix("").parts))

    from titan_primus.integrations.torchtitan import trainer_line

    line = trainer_line()
    train = line.install_hooks(
        _record, flip_last_bit, metrics=bool(os.environ.get(METRICS_ENV)), last_bit=os.environ.get(LAST_BIT_ENV) == "1"
    )
    code = train()
    if cpu_launcher:
        from titan_primus.integrations.torchtitan.common.cpu_world import exit_without_teardown

        exit_without_teardown(code)


if __name__ == "__main__":
    main()
