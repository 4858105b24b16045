"""``Float8Converter``: TorchTitan 0.3's way in. One entry in a model's converters list rewrites
the model config tree so linears and MoE experts run their GEMMs on the best FP8 backend here."""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field, fields
from typing import Literal

from torchtitan.components.quantization import QuantizationConverter
from torchtitan.components.quantization.utils import swap_token_dispatcher
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts

from ..backends.base import Op
from ..device import DeviceProfile, resolve_device
from ..recipes import check_recipe_name
from ..registry import backends, get_backend
from ..routing import BackendUnavailableError, RoutingDecision, select_backend
from .modules import Fp8Linear, fp8_experts_class

__all__ = ["Float8Converter", "ConversionReport", "LayerRoute"]

logger = logging.getLogger("titan_primus")

# TorchAO's FP8 grouped GEMM needs every token group padded to a multiple of 16.
_TORCHAO_GROUP_ALIGNMENT = 16


def too_small_for_fp8(recipe: str, k: int, n: int) -> bool:
    """Linears whose FP8 GEMMs are not faster than bf16, per TorchAO's H100 measurements
    (torchao/float8 README performance tables; the heuristic TorchAO's _auto_filter_for_recipe
    uses). Measured on H100 only."""
    if recipe == "tensorwise":
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


@dataclass(frozen=True)
class LayerRoute:
    fqn: str
    kind: Literal["linear", "experts"]
    backend: str | None
    """Backend that runs it, or None when it stays in high precision."""
    reason: str


@dataclass
class ConversionReport:
    """What the converter did with every linear and expert block, and why."""

    device: DeviceProfile
    recipe: str
    decisions: dict[str, RoutingDecision] = field(default_factory=dict)
    layers: list[LayerRoute] = field(default_factory=list)

    def converted(self, kind: str | None = None) -> list[LayerRoute]:
        return [r for r in self.layers if r.backend and kind in (None, r.kind)]

    def skipped(self, kind: str | None = None) -> list[LayerRoute]:
        return [r for r in self.layers if not r.backend and kind in (None, r.kind)]

    def summary(self) -> str:
        lines = [f"titan-primus FP8 routing on {self.device.describe()}, recipe {self.recipe}:"]
        for kind, op in (("linear", "linear"), ("experts", "grouped_mm")):
            label = "linears" if kind == "linear" else "grouped experts"
            counts: dict[str, int] = defaultdict(int)
            for route in self.converted(kind):
                counts[route.backend] += 1
            decision = self.decisions.get(op)
            for backend, count in counts.items():
                lines.append(f"  {label}: {count} -> {backend} ({decision.recipe.describe()}; {decision.reason})")
                lines += [f"    passed over {name}: {why}" for name, why in decision.passed_over]
            by_reason: dict[str, list[str]] = defaultdict(list)
            for route in self.skipped(kind):
                by_reason[route.reason].append(route.fqn)
            for reason, fqns in by_reason.items():
                shown = ", ".join(fqns[:4]) + (f", ... ({len(fqns)} in all)" if len(fqns) > 4 else "")
                lines.append(f"  {label} kept in high precision: {shown}: {reason}")
        return "\n".join(lines)


def _replace(model_config, parent, attr, new_config):
    if parent is None:
        return new_config
    if isinstance(parent, list):
        parent[attr] = new_config
    else:
        setattr(parent, attr, new_config)
    return model_config


def _copy_as(config, new_cls, **extra):
    """``config``'s fields on ``new_cls`` (a subclass of its class), plus ``extra``."""
    return new_cls(**{f.name: getattr(config, f.name) for f in fields(config) if f.init}, **extra)


class Float8Converter(QuantizationConverter):
    """Run FP8 linears and grouped MoE GEMMs on Primus-Turbo, TorchAO or the emulation,
    whichever is best on the device, decided once at conversion time."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        backend: str = "auto"
        """"auto" (Primus-Turbo on MI300-class GPUs, TorchAO on other FP8 GPUs, else the
        emulation), or one of "primus_turbo", "torchao", "emulated" (or a plugin backend)."""
        recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "rowwise"
        """FP8 recipe, as TorchAO names them."""
        linears: bool = True
        """Convert Linear layers."""
        grouped_experts: bool = True
        """Convert MoE experts (GroupedExperts and subclasses) through their _grouped_mm seam."""
        filter_fqns: list[str] = field(default_factory=lambda: ["router.gate"])
        """Layers whose FQN contains any of these substrings stay in high precision. The default
        keeps MoE router gates exact: their logits decide which experts see which tokens."""
        auto_filter_small_kn: bool = False
        """Keep linears too small to gain from FP8 (TorchAO's H100 thresholds) in high precision."""
        strict: bool = False
        """Raise instead of falling back when the device's preferred backend (or the one named
        in ``backend``) cannot run an op."""
        device: str | None = None
        """Route as if on this named device profile ("gfx942", "sm90", "cpu", ...); default: the
        detected device."""

    def __init__(self, config: Config):
        self.config = config
        check_recipe_name(config.recipe)
        if config.backend != "auto":
            get_backend(config.backend)  # unknown names fail here, with the registered ones listed
        self.device = resolve_device(config.device)
        self.report = ConversionReport(self.device, config.recipe)
        # Set whatever model_compile_enabled says: it is computed before the CLI's
        # --compile.enable is applied. Without it inductor fuses away the FP8 casts' rounding and
        # compiled numerics drift from eager (pytorch/pytorch#150859; TorchTitan sets it too).
        import torch._inductor.config

        torch._inductor.config.emulate_precision_casts = True

    def _route(self, op: Op) -> RoutingDecision:
        cfg, device = self.config, self.device
        try:
            decision = select_backend(op, cfg.recipe, device, cfg.backend)
        except BackendUnavailableError as e:
            if cfg.strict or cfg.backend == "auto":
                raise
            logger.warning("titan-primus: %s; falling back to automatic routing (strict=False)", e)
            decision = select_backend(op, cfg.recipe, device, "auto")
        if cfg.strict and cfg.backend == "auto":
            preferred = max(backends().values(), key=lambda b: b.rank(device))
            if decision.backend is not preferred:
                why = dict(decision.passed_over).get(preferred.name, "it was not chosen")
                raise BackendUnavailableError(
                    f"strict=True: {preferred.name}, the preferred FP8 backend on {device.describe()}, "
                    f"cannot run {op} with recipe {cfg.recipe!r}: {why}"
                )
        self.report.decisions[op] = decision
        return decision

    def _skip_reason(self, fqn: str, decision: RoutingDecision, op: Op, k: int, n: int) -> str | None:
        matched = [f for f in self.config.filter_fqns if f in fqn]
        if matched:
            return f"matches filter_fqns entry {matched[0]!r}"
        if op == "linear" and self.config.auto_filter_small_kn and too_small_for_fp8(self.config.recipe, k, n):
            return f"too small to gain from FP8 (K={k}, N={n}; auto_filter_small_kn)"
        supported = decision.backend.supports(op, self.config.recipe, self.device, k=k, n=n)
        return None if supported else supported.reason

    def convert(self, model_config):
        if self.config.linears:
            model_config = self._convert_linears(model_config)
        if self.config.grouped_experts:
            model_config = self._convert_experts(model_config)
        logger.info(self.report.summary())
        return model_config

    def _convert_linears(self, model_config):
        matches = list(model_config.traverse(Linear.Config))
        if not matches:
            return model_config
        decision = self._route("linear")
        for fqn, linear, parent, attr in matches:
            if type(linear) is not Linear.Config:
                reason = f"{type(linear).__qualname__} has its own forward, which FP8 would replace"
            else:
                reason = self._skip_reason(fqn, decision, "linear", linear.in_features, linear.out_features)
            if reason:
                self.report.layers.append(LayerRoute(fqn, "linear", None, reason))
                continue
            new = _copy_as(linear, Fp8Linear.Config, fp8_backend=decision.backend_name, fp8_recipe=decision.recipe)
            model_config = _replace(model_config, parent, attr, new)
            self.report.layers.append(LayerRoute(fqn, "linear", decision.backend_name, decision.reason))
        return model_config

    def _convert_experts(self, model_config):
        matches = list(model_config.traverse(GroupedExperts.Config))
        if not matches:
            return model_config
        decision = self._route("grouped_mm")
        for fqn, experts, parent, attr in matches:
            # w1/w3: [R, dim] @ [dim, hidden]; w2: [R, hidden] @ [hidden, dim]
            reason = self._skip_reason(fqn, decision, "grouped_mm", experts.dim, experts.hidden_dim) or (
                self._skip_reason(fqn, decision, "grouped_mm", experts.hidden_dim, experts.dim)
            )
            if reason:
                self.report.layers.append(LayerRoute(fqn, "experts", None, reason))
                continue
            if decision.backend_name == "torchao":
                swap_token_dispatcher(parent, _TORCHAO_GROUP_ALIGNMENT)
            cls = fp8_experts_class(type(experts)._owner)
            new = _copy_as(experts, cls.Config, fp8_backend=decision.backend_name, fp8_recipe=decision.recipe)
            model_config = _replace(model_config, parent, attr, new)
            self.report.layers.append(LayerRoute(fqn, "experts", decision.backend_name, decision.reason))
        return model_config
