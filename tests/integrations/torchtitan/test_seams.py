"""Issue 41: every patch of TorchTitan's internals is a declared seam of its line (seams.py), and
``titan-primus doctor`` says whether each target is there. Runs on the installed line (the
``line`` fixture); v0_2/test_contracts.py adds the 0.2.x line's own checks."""

from __future__ import annotations

import types

import pytest

from titan_primus.diagnostics.environment import diagnose
from titan_primus.integrations.torchtitan import line_seams
from titan_primus.integrations.torchtitan.common.seams import Seam, replace_once


def test_every_seam_of_the_installed_line_finds_its_target():
    version, seams = line_seams()
    assert version and seams, "no TorchTitan line installed"
    assert {s.row()["missing"] for s in seams} == {None}
    assert len({s.name for s in seams}) == len(seams)


def test_doctor_lists_the_seams_and_names_a_missing_target(monkeypatch, line):
    _, seams = line_seams()
    rows = diagnose("cpu")["torchtitan_seams"]
    assert [r["name"] for r in rows] == [s.name for s in seams] and all(r["present"] for r in rows)
    owner, attribute = line.seams.METRIC_LOGGER.owner_and_attribute()
    monkeypatch.delattr(owner, attribute)
    missing = {r["name"]: r for r in diagnose("cpu")["torchtitan_seams"]}["validate_metrics"]
    assert not missing["present"] and "has no _build_metric_logger" in missing["missing"]


def test_a_seam_patches_once_and_says_what_it_cannot_find(monkeypatch):
    holder = types.ModuleType("titan_primus_seam_target")
    holder.Owner = type("Owner", (), {"method": lambda self: 1})
    monkeypatch.setitem(__import__("sys").modules, holder.__name__, holder)
    seam = Seam("twice", f"{holder.__name__}:Owner.method", "test", "idempotence")
    calls = []

    def wrap(original):
        calls.append(original)
        return lambda self: original(self) + 1

    first = replace_once(seam, wrap)
    assert replace_once(seam, wrap) is first and len(calls) == 1
    assert holder.Owner().method() == 2
    assert (
        Seam("gone", f"{holder.__name__}:Owner.absent", "test", "").missing()
        == f"{holder.__name__}:Owner has no absent"
    )
    assert "ModuleNotFoundError" in Seam("gone", "no_such_module_here:x", "test", "").missing()
    with pytest.raises(AttributeError):
        replace_once(Seam("gone", f"{holder.__name__}:Owner.absent", "test", ""), wrap)


def test_the_cpu_launcher_skips_the_trainers_wait_after_the_last_step_and_nothing_else(line):
    """Rank 0 of TorchTitan's trainer sleeps 2 s after its last step; the CPU launcher's ranks end
    by themselves, so its trainer module's ``time`` has a ``sleep`` that returns at once and every
    other function of ``time`` unchanged; ``time`` itself is untouched."""
    import time

    assert line.launch  # importing it applies the CPU seams
    owner, attribute = line.seams.END_OF_TRAINING_WAIT.owner_and_attribute()
    trainer_time = getattr(owner, attribute)
    assert trainer_time is not time and time.sleep.__module__ == "time"
    start = time.perf_counter()
    trainer_time.sleep(5)
    assert time.perf_counter() - start < 1
    assert trainer_time.perf_counter is time.perf_counter and trainer_time.monotonic is time.monotonic
