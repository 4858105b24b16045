"""A TorchTitan line's CPU launcher with each logged step's metrics appended, one JSON object per
line, to the file ``TITAN_PRIMUS_TEST_METRICS`` names: the line's metric-logger seam
(``TrainerLine.record_step_metrics``, what ``validate`` reads), so the tests take losses from the
trainer's own figures, never from its log.

Run as a file: ``python metrics_launch.py LAUNCHER_MODULE TRAINER_ARGS...`` (under torchrun for
several ranks), LAUNCHER_MODULE e.g. ``titan_primus.integrations.torchtitan.v0_3.launch``.
"""

import importlib
import json
import os
import sys

METRICS_ENV = "TITAN_PRIMUS_TEST_METRICS"


def _append(entry: dict) -> None:
    with open(os.environ[METRICS_ENV], "a") as f:
        f.write(json.dumps(entry) + "\n")


def main() -> None:
    launcher = sys.argv.pop(1)
    # The launcher's CPU workarounds precede every other torchtitan import; its line is the
    # package beside it (TorchTitan main runs the 0.3 line's, which no version check would pick).
    importlib.import_module(launcher)
    line = importlib.import_module(launcher.rpartition(".")[0] + ".trainer").LINE
    from titan_primus.integrations.torchtitan.common.cpu_world import exit_without_teardown

    line.record_step_metrics(_append)
    exit_without_teardown(line.train())


if __name__ == "__main__":
    main()
