"""Plugin backends that are wrong on purpose, for the CLI's and the CPU gate's tests
(tests/unit/test_cli.py, tests/unit/test_cli_ci.py): one 1.5x off, one that raises, and the pluggy
plugin that registers either."""

from titan_primus.backends.emulated import EmulatedBackend
from titan_primus.backends.emulated.attention import EmulatedAttention
from titan_primus.hookspec import hookimpl

__all__ = ["CrashingBackend", "Plugin", "WrongBackend"]


class WrongAttention(EmulatedAttention):
    def fp8_attention(self, q, k, v, *, causal, softmax_scale):
        return super().fp8_attention(q, k, v, causal=causal, softmax_scale=softmax_scale) * 1.5


class CrashingAttention(EmulatedAttention):
    def fp8_attention(self, q, k, v, *, causal, softmax_scale):
        raise RuntimeError("kernel launch failed")


class WrongBackend(EmulatedBackend):
    """Ranks itself above every backend, then returns 1.5x the right answer (and so 1.5x gradients)."""

    name = "wrong"

    def rank(self, device):
        return 1000

    def linear(self, x, weight, bias, recipe):
        return super().linear(x, weight, bias, recipe) * 1.5

    def grouped_mm(self, A, B_t, offs, recipe):
        return super().grouped_mm(A, B_t, offs, recipe) * 1.5

    def attention(self):
        return WrongAttention


class CrashingBackend(EmulatedBackend):
    name = "crashing"

    def linear(self, x, weight, bias, recipe):
        raise RuntimeError("kernel launch failed")

    grouped_mm = linear

    def attention(self):
        return CrashingAttention


class Plugin:
    def __init__(self, backend_class):
        self.backend_class = backend_class

    @hookimpl
    def titan_primus_register_backends(self):
        return [self.backend_class()]
