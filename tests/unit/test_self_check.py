"""Issue 42: a numeric self-check at conversion. A backend whose kernels come from an upstream
(``checked_at_conversion``) runs each routed op once on a tiny input against the emulation of the
same definition; other numbers under the same signature (a scale 1.5x off, a transposed scale, an
fp32 output) stop conversion with the figures, before the first step. The tier runs it on
Primus-Turbo's own code (tests/real_turbo/test_rules.py)."""

from __future__ import annotations

import pytest
import torch

import titan_primus as tp
from titan_primus.backends.emulated import EmulatedBackend
from titan_primus.conversion import ConversionOptions, LayerRouter
from titan_primus.hookspec import hookimpl
from titan_primus.self_check import Fp8SelfCheckError, _PASSED


class _Upstream(EmulatedBackend):
    """The emulation's numbers, declared as an upstream's kernels (so conversion checks them),
    with one change a release could make under an unchanged signature."""

    checked_at_conversion = True
    calls = 0

    def rank(self, device):
        return 1000

    def linear(self, x, weight, bias, recipe, shards=None):
        type(self).calls += 1
        return self.changed(super().linear(x, weight, bias, recipe))

    def changed(self, out):
        return out


class ScaleOff(_Upstream):
    name = "scale_off"

    def changed(self, out):
        return out * 1.5


class Fp32Output(_Upstream):
    name = "fp32_output"

    def changed(self, out):
        return out.float()


class Unchanged(_Upstream):
    name = "unchanged"


@pytest.fixture
def registered(request):
    backend = request.param()

    class Plugin:
        @hookimpl
        def titan_primus_register_backends(self):
            return [backend]

    plugin = Plugin()
    tp.registry.register(plugin, name=backend.name)
    _PASSED.clear()
    yield backend
    tp.registry.unregister(plugin)
    _PASSED.clear()


def _route(name: str):
    return LayerRouter(ConversionOptions(backend=name, recipe="rowwise", device="cpu")).decision("linear")


@pytest.mark.parametrize(
    "registered, expected",
    [
        (ScaleOff, "out SQNR 6.0 dB < 40 dB vs the emulation"),
        (Fp32Output, "out is torch.float32, the contract is torch.bfloat16"),
    ],
    indirect=["registered"],
    ids=["scale 1.5x off", "fp32 output"],
)
def test_other_numbers_under_the_same_signature_stop_conversion_with_the_figures(registered, expected):
    with pytest.raises(Fp8SelfCheckError) as raised:
        _route(registered.name)
    message = str(raised.value)
    assert f"the {registered.name} backend's linear with rowwise" in message and expected in message
    assert (
        "against the exact emulation" in message and "Fix: install a version verified with this titan-primus" in message
    )


@pytest.mark.parametrize("registered", [Unchanged], indirect=True)
def test_a_kernel_that_agrees_passes_once_per_process(registered):
    assert _route(registered.name).backend_name == "unchanged"
    calls = Unchanged.calls
    assert calls > 0
    _route(registered.name)  # a second converter: the result is cached
    assert Unchanged.calls == calls


def test_the_emulation_and_plugins_built_on_it_are_not_checked():
    assert not EmulatedBackend.checked_at_conversion
    assert tp.registry.get_backend("torchao").checked_at_conversion
    _PASSED.clear()
    assert _route("emulated").backend_name == "emulated" and not _PASSED
    torch.manual_seed(0)  # the check draws from its own generator: the caller's stream is untouched
    expected = torch.randn(3)
    torch.manual_seed(0)
    _route("torchao")
    assert torch.equal(torch.randn(3), expected)
    assert any(key[0] == "torchao" for key in _PASSED)


class Raises(_Upstream):
    name = "raises"

    def changed(self, out):
        raise RuntimeError("missing value for argument 'new_required'")


@pytest.mark.parametrize("registered", [Raises], indirect=True)
def test_a_kernel_that_raises_stops_conversion_where_it_runs_and_is_left_to_its_hardware_elsewhere(registered):
    """On the device it runs on, a kernel that raises on the tiny input (a new required argument)
    stops conversion, not the first step; under a named profile of other hardware (routing asked
    about a machine that is not this one) its kernels may not run here at all: not checked here."""
    with pytest.raises(
        Fp8SelfCheckError, match="raises's linear with rowwise .* raised on a tiny input at conversion: "
    ):
        LayerRouter(ConversionOptions(backend="raises", recipe="rowwise")).decision("linear")
    decision = LayerRouter(ConversionOptions(backend="raises", recipe="rowwise", device="gfx942")).decision("linear")
    assert decision.backend_name == "raises"
    assert "not run on this host under the named profile gfx942" in next(iter(_PASSED.values()))


@pytest.mark.parametrize("registered", [ScaleOff], indirect=True)
def test_doctor_check_kernels_runs_the_self_check_on_every_routed_op_and_fails_on_a_changed_kernel(registered, capsys):
    """``titan-primus doctor --check-kernels``: an upgrade checked on a node without training. A row
    per routed op and recipe; a kernel that fails is a row, and the exit code says so."""
    import json

    from titan_primus import cli

    assert cli.main(["doctor", "--json"]) == 0
    assert "kernel_checks" not in json.loads(capsys.readouterr().out)
    assert cli.main(["doctor", "--json", "--check-kernels"]) == 1
    rows = {(r["op"], r["recipe"]): r for r in json.loads(capsys.readouterr().out)["kernel_checks"]}
    linear = rows["linear", "rowwise"]
    assert linear["backend"] == "scale_off" and linear["status"] == "fail"
    assert "out SQNR 6.0 dB < 40 dB" in linear["result"]
    assert rows["grouped_mm", "rowwise"]["status"] == "pass"  # only its linear was changed
    assert cli.main(["doctor", "--check-kernels"]) == 1
    assert "numeric self-check of each routed op" in capsys.readouterr().out
