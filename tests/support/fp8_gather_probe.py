"""A test-only probe of FSDP2's FP8 all-gathers inside TorchTitan's trainer: each call of
``Fp8AllGatherWeight.fsdp_pre_all_gather`` appends one JSON line, ``[the shape FSDP2 shards, the
FSDP degree, "fp8" or "high precision"]``, to ``$TITAN_PRIMUS_GATHER_PROBE.<rank>``. Imported by
TorchTitan 0.3's ``--override.imports support.fp8_gather_probe.probe`` (an override that changes
nothing) and by TorchTitan 0.2's custom_import (tests/integrations/torchtitan/v0_2/gather_probe.py);
tests/ must be on PYTHONPATH."""

import json
import os

from titan_primus.fsdp_fp8 import Fp8AllGatherWeight

_pre_all_gather = Fp8AllGatherWeight.fsdp_pre_all_gather


def _recording_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):  # FSDP2 reads the signature
    inputs, metadata = _pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy)
    how = "high precision" if metadata[0] == "high precision" else "fp8"
    with open(f"{os.environ[VARIABLE]}.{os.environ.get('RANK', '0')}", "a") as f:
        f.write(json.dumps([list(outer_size), mesh.size(), how]) + "\n")
    return inputs, metadata


VARIABLE = "TITAN_PRIMUS_GATHER_PROBE"
if VARIABLE in os.environ:  # in the trainer's ranks, not in the test reading the record
    Fp8AllGatherWeight.fsdp_pre_all_gather = _recording_pre_all_gather


def read(record) -> list[list]:
    """The lines a run's rank recorded at ``record`` (the path with the rank appended), in order."""
    return [json.loads(line) for line in open(record).read().splitlines()] if os.path.exists(record) else []


def assert_expert_weights_gathered_fp8(runs: dict, experts: list, expert_gathers: int, fsdp: int, label: str) -> None:
    """``runs``: {FP8 all-gather on, off: (losses, each rank's records, log)} of one trainer
    config. With it on, every rank gathers each expert weight ``expert_gathers`` times as
    ``experts`` (``[its shape, FSDP degree, "fp8"]``) and every linear in FP8 over ``fsdp`` ranks,
    and no layer is named as gathering bf16; with it off nothing is recorded; the losses are equal."""
    (on, gathers, log), (off, gathers_off, _) = runs[True], runs[False]
    assert "grouped experts: FSDP2 weight all-gather in FP8 payload + scales" in log and "in bf16" not in log
    for rank_gathers in gathers:
        assert [g for g in rank_gathers if len(g[0]) == 3] == [experts] * expert_gathers, rank_gathers
        assert all(how == "fp8" and world == fsdp for shape, world, how in rank_gathers if len(shape) == 2)
    assert gathers_off == [[]] * len(gathers)
    assert on == off and len(on) > 1, (on, off)
    print(f"{label}: FP8 all-gather on {on}, off {off}")


try:
    from torchtitan.config.override import override
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
except ImportError:  # TorchTitan 0.2: its custom_import module imports this one
    pass
else:

    @override(target=SelectiveAC.Config, description="records FSDP2's FP8 all-gathers (titan-primus tests)")
    def probe(config: SelectiveAC.Config) -> SelectiveAC.Config:
        return config
