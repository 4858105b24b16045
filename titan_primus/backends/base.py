"""The op interface every backend implements (built-in or third-party, via pluggy).

A backend is an object with a ``name`` and the methods below. Routing calls the first four once
per (op, recipe, device) at conversion time; ``linear`` and ``grouped_mm`` are the hot path and
receive inputs that were already validated.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from ..device import DeviceProfile
from ..recipes import Fp8Recipe

__all__ = [
    "AttentionKernels",
    "Op",
    "OPS",
    "StockPath",
    "Verdict",
    "Fp8Backend",
    "TensorParallelShards",
    "kept_for_gradients",
]

Op = Literal["linear", "grouped_mm"]
OPS: tuple[Op, ...] = ("linear", "grouped_mm")


def kept_for_gradients(ctx, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """What an FP8 GEMM's autograd Function (inputs ``a``, ``b`` first) keeps of its two operands:
    each one only where the other's gradient is needed (the GEMM of one operand's gradient
    contracts the other with the output's gradient). A frozen weight keeps no activation.
    Records both operands' dtypes on ``ctx`` (``a_dtype``, ``b_dtype``) for the gradients' casts."""
    ctx.a_dtype, ctx.b_dtype = a.dtype, b.dtype
    return (a if ctx.needs_input_grad[1] else None), (b if ctx.needs_input_grad[0] else None)


@dataclass(frozen=True)
class Verdict:
    """Yes or no, with one sentence a user can act on."""

    ok: bool
    reason: str = ""

    @classmethod
    def yes(cls, reason: str = "") -> "Verdict":
        return cls(True, reason)

    @classmethod
    def no(cls, reason: str) -> "Verdict":
        return cls(False, reason)

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True)
class TensorParallelShards:
    """Which dimension of a linear's operands this rank holds only a shard of, across ``group``
    (tensor parallelism): ``None`` where the operand is whole. x is [M, K], weight [N, K],
    grad_output [M, N]. Column-parallel: weight dim 0 and grad_output dim 1; row-parallel:
    weight dim 1 and x dim 1. A backend that takes it reduces every amax taken over a sharded
    dimension across the group, so each rank's scales are the ones one device computes."""

    group: object
    input_dim: int | None
    weight_dim: int | None
    grad_output_dim: int | None


class AttentionKernels(ABC):
    """A backend's attention capability, built at conversion for one device and kept by each
    route (:class:`titan_primus.attention.AttentionRoute`): whatever the kernels need besides the
    tensors (formats, settings read from the environment) is read here, once, never per call.
    Tensors are bf16, bshd (B, L, H, D) for FP8 attention, packed (T, H, D) for flash attention."""

    fp8: ClassVar[bool] = False
    """Provides FP8 attention: Primus-Turbo's definition (``flash_attn_fp8_func``, blockwise 64),
    whose rules are :func:`titan_primus.attention.fp8_attention_refusal`."""
    bf16: ClassVar[bool] = False
    """Provides bf16 flash attention (causal, full, windows, packed documents)."""
    performance_path: ClassVar[bool] = True
    """False for a reference implementation (the emulation): bench times it only on a CPU."""

    def __init__(self, device: DeviceProfile, fp8: bool):
        self.fp8_format: torch.dtype | None = device.e4m3 if fp8 else None
        """The e4m3 format FP8 attention quantizes to (the device's: FNUZ on gfx942)."""

    @classmethod
    def forward_ops(cls) -> frozenset:
        """The ops (``torch._ops.OpOverload``) whose outputs are these kernels' forward results:
        selective activation checkpointing saves them (titan_primus.checkpointing). Ops whose
        library is not imported are left out. Default: none."""
        return frozenset()

    @staticmethod
    def unavailable(fp8: bool) -> str | None:
        """Why the FP8 (``fp8``) or bf16 kernels cannot run with what is installed, if so (an
        upstream whose attention functions differ from the calls the backend makes)."""
        return None

    @staticmethod
    def bf16_refusal(head_dims: tuple[int, int] | None) -> str | None:
        """Why the bf16 kernels cannot take these (query/key, value) head dims, if so."""
        return None

    def fp8_attention(self, q, k, v, *, causal: bool, softmax_scale: float | None) -> torch.Tensor:
        """FP8 attention of q (B, L, Hq, D) over k, v (B, L, Hkv, D / Dv): (B, L, Hq, Dv) bf16,
        differentiable; ``softmax_scale`` None is D ** -0.5."""
        raise NotImplementedError(f"{type(self).__name__} has no FP8 attention")

    def flash_attention(
        self, q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int, *, softmax_scale, causal: bool, window
    ) -> torch.Tensor:
        """bf16 attention of packed (T, Hq, D) ``q`` over (T, Hkv, D / Dv) ``k``/``v``, sequences
        at the int32 ``cu_seqlens`` (the longest ``max_seqlen``); ``window`` (left, right) in
        flash-attention's convention."""
        raise NotImplementedError(f"{type(self).__name__} has no bf16 flash attention")


@dataclass(frozen=True)
class StockPath:
    """The upstream library's own entry point for an op, as a user of that library alone calls
    it: the peer ``titan-primus bench`` times beside the backend that wraps it, and whose outputs
    it compares with the backend's."""

    label: str
    """What it is, e.g. "TorchAO convert_to_float8_training"."""
    forward: Callable
    """``forward(a, w, offs)``: a [M, K]; w [N, K] (a linear's weight) or [E, N, K] (expert
    weights); offs the groups' int32 end offsets (unused by a linear)."""


class Fp8Backend(ABC):
    """One FP8 implementation of the two GEMM ops, and optionally of attention (:meth:`attention`)."""

    name: ClassVar[str]
    tensor_parallel_scales: ClassVar[bool] = False
    """Whether ``linear`` takes ``shards`` (TensorParallelShards) and computes whole-tensor scales."""
    recipes: ClassVar[tuple[str, ...]] = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
    """The recipe names this backend implements; routing refuses the others before asking
    ``supports``. Recipes added to titan-primus later (``mxfp8``, ``blockwise``) reach a backend
    only once it lists them."""
    checked_at_conversion: ClassVar[bool] = False
    """Its kernels come from an upstream that can change their numbers under an unchanged
    signature (Primus-Turbo, TorchAO): conversion runs each op routed to it once on a tiny input
    against the emulation before training (titan_primus.self_check)."""
    reference: ClassVar[bool] = False
    """The exact reference every other backend is compared with (the emulation): it runs every
    recipe definition on every device. parity judges the others against it, bench and the memory
    audit use its FP8 attention where no GPU kernel runs. At most one registered backend is, and
    it is never inherited: a backend built on the emulation (a plugin subclassing it) is not the
    reference unless its own class says so."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "reference" not in vars(cls):
            cls.reference = False

    @abstractmethod
    def rank(self, device: DeviceProfile) -> int:
        """Preference under ``backend="auto"`` on ``device``: the highest available one wins;
        0 means never chosen automatically there (it may still be requested by name)."""

    @abstractmethod
    def availability(self, device: DeviceProfile) -> Verdict:
        """Can this backend run on ``device`` at all (hardware, importable dependencies)?"""

    @abstractmethod
    def supports(
        self, op: Op, recipe: str, device: DeviceProfile, k: int | None = None, n: int | None = None
    ) -> Verdict:
        """Does it implement ``op`` with ``recipe`` on ``device``, for a contracted dim ``k`` and
        output dim ``n`` when given? Called after ``availability`` said yes."""

    def installed(self) -> str:
        """The upstream whose kernels it runs, as installed ("TorchAO 0.18.0"), for messages about
        them; "" for a backend of titan-primus's own code."""
        return ""

    def chosen_automatically(self, op: Op, recipe: str, device: DeviceProfile) -> Verdict:
        """May ``backend="auto"`` pick this backend for ``op`` with ``recipe`` on ``device``, where
        it can run it? No: it runs that only when requested by name (a path not yet run on the
        hardware it needs); routing passes it over with the reason. Default: yes."""
        return Verdict.yes()

    @abstractmethod
    def recipe_for(self, recipe: str, device: DeviceProfile) -> Fp8Recipe:
        """The exact numerics this backend runs for ``recipe`` on ``device``."""

    @abstractmethod
    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        recipe: Fp8Recipe,
        shards: TensorParallelShards | None = None,
    ) -> torch.Tensor:
        """``x @ weight.T + bias`` for 2-D ``x`` [M, K] and ``weight`` [N, K], with autograd.
        ``shards`` is given only to backends with ``tensor_parallel_scales``."""

    @abstractmethod
    def grouped_mm(self, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
        """TorchTitan's ``GroupedExperts._grouped_mm`` contract, with autograd: A [R, K],
        B_t [E, K, N], offs int32 cumulative end offsets [E], groups of any size (empty ones
        included); rows past offs[-1] are zero."""

    def attention(self) -> type[AttentionKernels] | None:
        """This backend's attention kernels (a class: its ``fp8`` and ``bf16`` say what it
        provides; routing builds one per device), or None: attention layers are never routed
        to it. Default: none."""
        return None

    def group_alignment(self, recipe: Fp8Recipe) -> int | None:
        """The multiple of rows this backend's grouped-GEMM kernels need every token group
        padded to, or None. ``grouped_mm`` pads groups itself unless
        ``recipe.token_groups_padded_to`` says the dispatcher did; the converters install
        TorchTitan's padding dispatcher for such backends."""
        return None

    @abstractmethod
    def accepts(self, recipe: Fp8Recipe) -> Verdict:
        """Can this backend run a recipe object built elsewhere (e.g. one definition compared
        across backends in a parity run)?"""

    def bit_exact_with_emulation(self, op: Op, recipe: Fp8Recipe) -> bool:
        """Whether ``op`` computes bit for bit what the emulation of ``recipe`` computes from the
        same inputs on the same device. The numerics sentinel compares such a backend bitwise
        with the emulation, any other by SQNR against a floor."""
        return False

    def fp8_gemm_ops(self) -> frozenset:
        """The ops (``torch._ops.OpOverload``) whose outputs are this backend's GEMM results, on
        every path it takes (eager, compiled; every recipe): selective activation checkpointing
        saves their outputs rather than run them again in backward (titan_primus.checkpointing),
        and GEMM counts count their calls. Ops this backend cannot name here (its library not
        importable) are left out. Default: none."""
        return frozenset()

    def slower_than_bf16(self, op: Op, recipe: Fp8Recipe, device: DeviceProfile) -> str | None:
        """A measurement of ``op`` on this backend, on ``device``'s model of GPU, where FP8 was no
        faster than bf16 (the routing report shows it, with how to keep the op in bf16), as "what
        was measured, how, when"; None where nothing such was measured. Default: none."""
        return None

    def stock_path(self, op: Op, recipe: Fp8Recipe) -> tuple[StockPath | None, Verdict]:
        """The upstream library's own entry point for ``op`` and ``recipe`` (bench times it
        beside this backend), or None with the reason there is none. Default: none."""
        return None, Verdict.no(f"the {self.name} backend names no stock upstream path")

    def takes_gathered_fp8_weight(self, recipe: Fp8Recipe, op: Op = "linear") -> Verdict:
        """Can ``op`` (``linear``'s weight, or ``grouped_mm``'s B_t, a transposed view of expert
        weights) consume a weight FSDP2 all-gathered as FP8 (the forward cast of ``recipe``),
        built by :meth:`gathered_weight`, without re-quantizing it?"""
        return Verdict.no(f"the {self.name} backend cannot take a pre-quantized weight yet")

    def gathered_weight(
        self,
        data: torch.Tensor,
        scale: torch.Tensor,
        dtype: torch.dtype,
        recipe: Fp8Recipe,
        source_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """The unsharded weight the op receives, from the gathered FP8 ``data`` ([N, K], or
        [E, N, K] for expert weights) and float32 ``scale`` ([] tensorwise, [N, 1] / [E, N, 1]
        rowwise); it presents ``dtype``, and ``source_dtype`` is the dtype the payload was
        quantized from (default ``dtype``)."""
        raise NotImplementedError(f"the {self.name} backend cannot take a pre-quantized weight")
