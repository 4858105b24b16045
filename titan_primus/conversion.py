"""What an FP8 model converter decides for each layer, and the report of it.

TorchTitan-independent: each TorchTitan adapter walks its model its own way (0.3 rewrites the
config tree, 0.2.x swaps modules on the meta model) and asks one :class:`LayerRouter`, layer by
layer, whether a linear or an MoE expert block runs in FP8 and on which backend. So both lines
take the same options, make the same decisions and print the same report.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from collections.abc import Sequence
from typing import Literal

from .attention.route import AttentionRoute, AttentionSite, route_attention
from .backends.base import Op, Verdict
from .device import DeviceProfile, device_profile, resolve_device
from .fsdp_fp8 import fp8_all_gather_plan
from .recipes import check_recipe_name
from .registry import backends, get_backend
from .routing import BackendUnavailableError, RoutingDecision, preferred_backend, select_backend
from .self_check import attention_self_check, self_check
from .sentinel.options import SentinelOptions, sentinel_options

__all__ = [
    "ConversionOptions",
    "ConversionReport",
    "LayerRoute",
    "LayerRouter",
    "check_parallelism",
    "keep_fp8_cast_rounding_under_inductor",
    "too_small_for_fp8",
]

logger = logging.getLogger("titan_primus")


# Token-group alignment a backend's FP8 grouped GEMM needs. TorchAO's needs every group padded
# to a multiple of 16, and of its MX block (32) for mxfp8; Primus-Turbo and the emulation take
# ragged groups (Primus-Turbo pads each group to its block inside its block-scaled kernels).
def too_small_for_fp8(recipe: str, k: int, n: int) -> bool:
    """Linears whose FP8 GEMMs are not faster than bf16, per TorchAO's H100 measurements
    (torchao/float8 README performance tables; the heuristic TorchAO's _auto_filter_for_recipe
    uses). Measured on H100 only."""
    if recipe == "tensorwise":
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


def check_parallelism(
    layer: str, parallel_dims, decision_or_recipe, *, experts: bool, passes_shards: bool = False
) -> None:
    """Refuse, before the first step, the parallelisms under which an FP8 ``layer``'s scales
    would be computed over part of a tensor and silently differ from a single device's.

    ``parallel_dims``: TorchTitan's ParallelDims (its ``tp`` and ``ep`` degrees);
    ``decision_or_recipe``: the layer's backend and recipe (a RoutingDecision, or the
    (backend, recipe) pair a module holds). FSDP is fine: it all-gathers the full weight before
    each forward. Tensor parallelism hands each rank a shard: fine for a linear whose module
    tells its backend the shards (``passes_shards``) and whose backend reduces amaxes across
    them (``tensor_parallel_scales``); refused otherwise, and for MoE experts. Expert
    parallelism is fine when every grouped-GEMM scale covers one expert's data, or where the
    recipe defines its scales that span experts over a rank's experts
    (:attr:`~titan_primus.recipes.Fp8Recipe.expert_parallel_scales`).
    """
    backend, recipe = (
        (decision_or_recipe.backend, decision_or_recipe.recipe)
        if isinstance(decision_or_recipe, RoutingDecision)
        else decision_or_recipe
    )
    if parallel_dims.tp > 1 and recipe.block_scaled:
        raise ValueError(
            f"titan-primus: tensor parallelism (degree {parallel_dims.tp}) is not supported with the "
            f"block-scaled recipe {recipe.describe()} yet: its blocks would have to align with every "
            f"shard boundary. Use FSDP (data_parallel_shard_degree) and expert parallelism, which "
            f"keep every block whole, or keep TP-sharded layers in high precision with filter_fqns."
        )
    if parallel_dims.tp > 1 and (experts or not (passes_shards and backend.tensor_parallel_scales)):
        what = "MoE experts" if experts else f"the {backend.name} backend" + ("" if passes_shards else " here")
        raise ValueError(
            f"titan-primus: tensor parallelism (degree {parallel_dims.tp}) is not supported for FP8 "
            f"{what} yet: each rank's {layer} would compute FP8 scales over its shard only, so the "
            f"numerics would differ from one device. Use FSDP (data_parallel_shard_degree) with the "
            f"converter, or keep TP-sharded layers in high precision with filter_fqns"
            + ("" if experts else " (the emulated backend computes whole-tensor scales under TP)")
            + "."
        )
    if experts and parallel_dims.ep > 1 and recipe.expert_parallel_scales is None:
        raise ValueError(
            f"titan-primus: expert parallelism (degree {parallel_dims.ep}) with recipe "
            f"{recipe.describe()} is not supported: its grouped-GEMM scales span all experts, each "
            f"rank holds only some of them, and this definition has none over a rank's experts. Use "
            f"'rowwise' (per-expert scales), 'mxfp8' or 'blockwise' (per-expert blocks), Primus-Turbo's "
            f"definitions (scales over the rank's experts, as AMD Primus runs), or turn grouped_experts off."
        )


def keep_fp8_cast_rounding_under_inductor() -> None:
    """Without this, inductor fuses away the FP8 casts' rounding and compiled numerics drift from
    eager (pytorch/pytorch#150859; TorchTitan's own float8 converters set it too). Set whether or
    not compile is on: converters run before every compile option is known."""
    import torch._inductor.config

    torch._inductor.config.emulate_precision_casts = True


@dataclass(kw_only=True)
class ConversionOptions:
    """What to convert to FP8, and on which backend. Field names are the converter options of
    both TorchTitan lines (0.3's ``Float8Converter.Config``, 0.2.x's ``[titan_primus]`` section)."""

    backend: str = "auto"
    """"auto" (Primus-Turbo on MI300-class GPUs, TorchAO on other FP8 GPUs, the emulation on
    CPUs; on a GPU, layers no kernel there can run stay in high precision), or one of
    "primus_turbo", "torchao", "emulated" (or a plugin backend): that backend runs every converted
    op, or conversion raises with the reason (a named backend never falls back to another)."""
    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "blockwise"] = "rowwise"
    """FP8 recipe: TorchAO's names, plus "mxfp8" (MX: 1x32 blocks, E8M0 scales) and "blockwise"
    (DeepSeek-V3: 1x128 activation tiles, 128x128 weight blocks)."""
    linears: bool = True
    """Convert linear layers."""
    grouped_experts: bool = True
    """Convert MoE expert blocks: their grouped GEMMs run on the backend."""
    filter_fqns: list[str] = field(default_factory=lambda: ["router.gate"])
    """Layers whose FQN contains any of these substrings stay in high precision. The default
    keeps MoE router gates exact: their logits decide which experts see which tokens."""
    auto_filter_small_kn: bool = False
    """Keep linears too small to gain from FP8 (TorchAO's H100 thresholds) in high precision."""
    strict: bool = False
    """With ``backend="auto"``: raise instead of falling back when the device's preferred backend
    cannot run an op. A backend named in ``backend`` never falls back: where it cannot run an op,
    conversion raises with the reason, whatever ``strict`` says."""
    device: str | None = None
    """Route as if on this named device profile ("gfx942", "sm90", "cpu", ...); default: the
    detected device."""
    enable_fsdp_float8_all_gather: bool = False
    """Under FSDP2, all-gather the weights of FP8 linears and MoE experts as FP8 payload plus
    scales (about half the bytes) wherever that is bit-exact for the recipe and the backend
    takes a pre-quantized weight; elsewhere bf16, with the reason in the routing report."""
    fp8_dispatch: bool = False
    """Under expert parallelism, send the routed tokens across the all-to-all as the FP8 payload
    and scales of the recipe's activation cast (about half the bytes), where that is exact for
    the recipe (rowwise, TorchAO's mxfp8); combine and gradients stay in the activations' dtype.
    The experts then receive that FP8 copy: forward unchanged, the w1/w3 weight gradient cast
    from the copy (docs/token-dispatch.md). Elsewhere the tokens travel as without the option,
    with the reason in the routing report."""
    attention: bool = False
    """Run attention layers on Primus-Turbo's bf16 flash attention on MI300-class GPUs, masks kept
    (document masking through cu_seqlens, sliding windows, the model's softmax scale); elsewhere
    they stay TorchTitan's own. Off by default until it has run on an MI300 (docs/attention.md)."""
    fp8_attention: bool = False
    """Run attention in FP8 (Primus-Turbo's blockwise-64 kernel; its emulation on CPUs, to measured bounds) on
    the layers whose attention its definition can compute: plain causal or full, no window or
    dropout, sequence lengths a multiple of 64. Every other layer is refused with the reason in
    the routing report (and keeps bf16 Primus-Turbo attention with ``attention`` on)."""
    sentinel_interval: int = 0
    """Numerics sentinel (docs/sentinel.md): every this many steps, re-compute one converted layer
    (round robin) with the exact emulation of its recipe and compare; while on, every converted
    layer's outputs and gradients are also checked for NaN/inf on every step. 0: off."""
    sentinel_policy: Literal["warn", "stop"] = "warn"
    """What a sentinel breach does: log a warning, or stop training with the layer, step,
    backend and figures."""
    sentinel_capture_folder: str = "sentinel_captures"
    """Where the sentinel saves a breached layer's inputs (for ``titan-primus parity --replay``);
    "" saves nothing."""

    def check(self) -> None:
        """Raise ValueError naming the bad option. Config files reach here unchecked (TOML values
        are not type-checked), and a string ``filter_fqns`` would silently match by character."""
        for name in (
            "linears",
            "grouped_experts",
            "auto_filter_small_kn",
            "strict",
            "enable_fsdp_float8_all_gather",
            "fp8_dispatch",
            "attention",
            "fp8_attention",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"FP8 option {name!r} must be true or false, got {getattr(self, name)!r}")
        check_recipe_name(self.recipe)
        if not isinstance(self.backend, str):
            raise ValueError(f"FP8 option 'backend' must be a backend name or 'auto', got {self.backend!r}")
        if self.backend != "auto":
            get_backend(self.backend)  # unknown names fail here, with the registered ones listed
        if not isinstance(self.filter_fqns, (list, tuple)) or not all(isinstance(f, str) for f in self.filter_fqns):
            raise ValueError(
                f"FP8 option 'filter_fqns' must be a list of FQN substrings such as [\"router.gate\"], "
                f"got {self.filter_fqns!r}"
            )
        if self.device is not None:
            device_profile(self.device)  # unknown names fail here, with the known profiles listed
        self.sentinel()  # bad sentinel options fail here, named

    def sentinel(self) -> SentinelOptions | None:
        """The numerics sentinel's options, or None when it is off."""
        return sentinel_options(self.sentinel_interval, self.sentinel_policy, self.sentinel_capture_folder)


KeptBecause = Literal["filter_fqns", "auto_filter_small_kn", "unconvertible", "unsupported", "no_backend"]


@dataclass(frozen=True)
class LayerRoute:
    fqn: str
    kind: Literal["linear", "experts"]
    backend: str | None
    """Backend that runs it, or None when it stays in high precision."""
    reason: str
    kept: KeptBecause | None = None
    """Why it stays in high precision (None when converted): the user's choice
    (``filter_fqns``, ``auto_filter_small_kn``), the adapter's (``unconvertible``), the backend's
    (``unsupported``: the op's shape), or ``no_backend``: no FP8 backend can run the op here."""


@dataclass
class ConversionReport:
    """What the converter did with every linear and expert block, and why."""

    device: DeviceProfile
    recipe: str
    decisions: dict[str, RoutingDecision] = field(default_factory=dict)
    layers: list[LayerRoute] = field(default_factory=list)
    fp8_all_gather: dict[str, Verdict] = field(default_factory=dict)
    """Per op, with enable_fsdp_float8_all_gather on: whether FSDP2 gathers its weights in FP8."""
    token_dispatch: dict[str, Verdict] = field(default_factory=dict)
    """Per FP8 expert block, with fp8_dispatch on: whether its routed tokens cross the EP
    all-to-all in FP8, and why (not)."""
    gathered_in_high_precision: dict[str, str] = field(default_factory=dict)
    """FP8 layers whose weights FSDP2 gathers in high precision although their op's weights go
    in FP8 (another module shares the weight; FSDP2's shards of it do not hold whole rows or
    blocks): fqn -> reason."""
    attention: list[AttentionRoute] = field(default_factory=list)
    """Every attention layer, with the ``attention`` or ``fp8_attention`` option on."""

    def converted(self, kind: str | None = None) -> list[LayerRoute]:
        return [r for r in self.layers if r.backend and kind in (None, r.kind)]

    def skipped(self, kind: str | None = None) -> list[LayerRoute]:
        return [r for r in self.layers if not r.backend and kind in (None, r.kind)]

    def as_dict(self) -> dict:
        """The report as plain data (validate records it from the trainer): per op the backend,
        definition and reason, the backend the device prefers, and every layer."""
        preferred = preferred_backend(self.device)
        return {
            "device": self.device.arch,
            "recipe": self.recipe,
            "preferred_backend": preferred.name if preferred else None,
            "ops": {
                op: {
                    "backend": d.backend_name,
                    "definition": d.recipe.describe(),
                    "reason": d.reason,
                    "passed_over": [list(p) for p in d.passed_over],
                }
                for op, d in self.decisions.items()
            },
            "layers": [asdict(route) for route in self.layers],
            "token_dispatch": {fqn: {"fp8": bool(v), "reason": v.reason} for fqn, v in self.token_dispatch.items()},
            "attention": {r.fqn: {"backend": r.backend, "fp8": r.fp8, "reason": r.reason} for r in self.attention},
        }

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
                if kind == "experts":
                    lines.append(f"    under expert parallelism: {decision.recipe.expert_parallel_scope()}")
                slower = decision.backend.slower_than_bf16(op, decision.recipe, self.device)
                if slower:
                    lines.append(
                        f"    not faster than bf16 here: {slower}; FP8 saves memory, not time: "
                        f"{'grouped_experts' if kind == 'experts' else 'linears'}=False keeps them in bf16"
                    )
            by_reason: dict[str, list[str]] = defaultdict(list)
            for route in self.skipped(kind):
                by_reason[route.reason].append(route.fqn)
            for reason, fqns in by_reason.items():
                lines.append(f"  {label} kept in high precision: {_listed(fqns)}: {reason}")
            if op in self.fp8_all_gather and self.converted(kind):
                verdict = self.fp8_all_gather[op]
                how = "FP8 payload + scales" if verdict else "bf16"
                lines.append(f"  {label}: FSDP2 weight all-gather in {how}: {verdict.reason}")
                lines += [
                    f"    except {fqn}, in bf16: {why}"
                    for fqn, why in self.gathered_in_high_precision.items()
                    if any(r.fqn == fqn for r in self.converted(kind))
                ]
        lines += self._token_dispatch_lines()
        lines += self._attention_lines()
        return "\n".join(lines)

    def _attention_lines(self) -> list[str]:
        by_route: dict[str, list[str]] = defaultdict(list)
        for route in self.attention:
            by_route[route.describe()].append(route.fqn)
        return [f"  attention: {_listed(fqns)} -> {how}" for how, fqns in by_route.items()]

    def _token_dispatch_lines(self) -> list[str]:
        by_verdict: dict[tuple[bool, str], list[str]] = defaultdict(list)
        for fqn, verdict in self.token_dispatch.items():
            by_verdict[bool(verdict), verdict.reason].append(fqn)
        lines = []
        for (fp8, reason), fqns in by_verdict.items():
            how = "FP8 payload + scales" if fp8 else "the activations' dtype"
            lines.append(f"  grouped experts: EP token dispatch in {how}: {_listed(fqns)}: {reason}")
        return lines


def _listed(fqns: list[str]) -> str:
    return ", ".join(fqns[:4]) + (f", ... ({len(fqns)} in all)" if len(fqns) > 4 else "")


class LayerRouter:
    """Decides, layer by layer, whether a model's GEMMs run in FP8 and on which backend.

    The backend for each op is chosen once (on the first layer that needs it) and every layer
    placed is recorded in :attr:`report`, converted or not, with the reason.
    """

    def __init__(self, options: ConversionOptions):
        options.check()
        self.options = options
        self.device = resolve_device(options.device)
        self.report = ConversionReport(self.device, options.recipe)
        self._unroutable: dict[str, str] = {}

    def decision(self, op: Op) -> RoutingDecision | None:
        """The backend that runs ``op`` here, decided on first use; None when no backend can
        (then every such layer stays in high precision, with the reason)."""
        if op not in self.report.decisions and op not in self._unroutable:
            try:
                self.report.decisions[op] = self._route(op)
            except BackendUnavailableError as e:
                if self.options.strict or self.options.backend != "auto":
                    raise
                logger.warning("titan-primus: %s; those layers stay in high precision", e)
                self._unroutable[op] = f"no FP8 backend here: {e}"
        return self.report.decisions.get(op)

    def linear(self, fqn: str, in_features: int, out_features: int, *, unconvertible: str | None = None):
        """The decision for the linear at ``fqn``, or None when it stays in high precision.
        ``unconvertible``: the adapter's reason it cannot convert this layer, if any."""
        decision = self.decision("linear")
        kept = ("unconvertible", unconvertible) if unconvertible else None
        kept = kept or self._skip_reason(fqn, decision, "linear", in_features, out_features)
        return self._record(fqn, "linear", decision, kept)

    def experts(self, fqn: str, dim: int, hidden_dim: int, *, unconvertible: str | None = None):
        """The decision for the expert block at ``fqn``, or None when it stays in high precision."""
        decision = self.decision("grouped_mm")
        # w1/w3: [R, dim] @ [dim, hidden]; w2: [R, hidden] @ [hidden, dim]
        kept = (
            (("unconvertible", unconvertible) if unconvertible else None)
            or self._skip_reason(fqn, decision, "grouped_mm", dim, hidden_dim)
            or self._skip_reason(fqn, decision, "grouped_mm", hidden_dim, dim)
        )
        return self._record(fqn, "experts", decision, kept)

    def fp8_all_gather(
        self,
        op: Op,
        fqn: str | None = None,
        shared_with: str | None = None,
        sharded: Sequence[tuple[tuple[int, ...], int, int]] | None = None,
    ) -> bool:
        """Whether FSDP2 all-gathers the FP8 weights of ``op`` as FP8 (the option is on and
        that is exact here), recorded with the reason in the report. For the layer at ``fqn``:
        ``shared_with`` names the module that shares its weight (tied weights), which then keeps
        its high-precision all-gather (the other module reads its values); ``sharded``: for each of
        its weights, (the shape FSDP2 shards, the dim it shards, FSDP degree), where known, keeps
        in high precision weights whose shards do not hold whole rows or blocks."""
        if not self.options.enable_fsdp_float8_all_gather:
            return False
        decision = self.decision(op)
        plan, verdict = fp8_all_gather_plan(decision.backend, decision.recipe, op)
        self.report.fp8_all_gather.setdefault(op, verdict)
        if plan is None:
            return False
        why = None
        if shared_with:
            why = (
                f"its weight is tied to {shared_with}, which reads it in high precision; "
                f"the FP8 GEMM quantizes the gathered weight as without the option"
            )
        elif sharded is not None:
            refusals = ((shape, plan.shard_refusal(shape, dim, world)) for shape, dim, world in sharded)
            why = next((f"{why} (weight {list(shape)})" for shape, why in refusals if why), None)
        if why:
            self.report.gathered_in_high_precision[fqn] = why
            return False
        return True

    def token_dispatch(self, fqn: str, recipe, *, unsupported: str | None = None) -> bool:
        """Whether the routed tokens of the FP8 expert block at ``fqn`` (running ``recipe``)
        cross the EP all-to-all in FP8 (the fp8_dispatch option is on and the recipe qualifies),
        recorded with the reason. ``unsupported``: the adapter's reason it cannot, if any."""
        if not self.options.fp8_dispatch:
            return False
        why_not = unsupported or recipe.fp8_dispatch_refusal
        if why_not:
            self.report.token_dispatch[fqn] = Verdict.no(why_not)
            return False
        what = "one scale per row" if recipe.output.a.granularity == "rowwise" else "one E8M0 scale per 1x32 tile"
        self.report.token_dispatch[fqn] = Verdict.yes(
            f"{what}, as the grouped GEMMs cast them (forward unchanged; the w1/w3 weight gradient casts the "
            f"FP8 copy); combine and gradients in the activations' dtype"
        )
        return True

    def attention(self, fqn: str, site: AttentionSite) -> AttentionRoute | None:
        """The route of the attention layer at ``fqn``, recorded in the report; None with both
        attention options off (nothing recorded: the layer is not the converter's concern)."""
        opts = self.options
        if not (opts.attention or opts.fp8_attention):
            return None
        route = route_attention(
            fqn, site, device=self.device, backend=opts.backend, bf16=opts.attention, fp8=opts.fp8_attention
        )
        if opts.strict and opts.attention and route.backend is None and self.device.mi300_class:
            raise BackendUnavailableError(f"strict=True: attention at {fqn} cannot run on Primus-Turbo: {route.reason}")
        figures = attention_self_check(route, self.device)
        if figures and not any((r.backend, r.fp8) == (route.backend, route.fp8) for r in self.report.attention):
            logger.info("titan-primus: %s attention self-check %s", route.backend, figures)
        self.report.attention.append(route)
        return route

    def _record(self, fqn, kind, decision: RoutingDecision, kept: tuple[KeptBecause, str] | None):
        if kept:
            self.report.layers.append(LayerRoute(fqn, kind, None, kept[1], kept[0]))
            return None
        self.report.layers.append(LayerRoute(fqn, kind, decision.backend_name, decision.reason))
        return decision

    def _route(self, op: Op) -> RoutingDecision:
        opts, device = self.options, self.device
        try:
            decision = select_backend(op, opts.recipe, device, opts.backend)
        except BackendUnavailableError as e:
            if opts.backend == "auto":
                raise
            # A backend the user names is kept: another backend would train another FP8 definition.
            raise BackendUnavailableError(
                f"{e}. backend={opts.backend!r} was named in the FP8 config, so no other backend runs it "
                f"in its place: run where {opts.backend} can run it, name another backend, or set "
                f'backend="auto" to route each op to the best backend that runs it here'
            ) from e
        if opts.strict and opts.backend == "auto":
            preferred = preferred_backend(device) or max(backends().values(), key=lambda b: b.rank(device))
            if decision.backend is not preferred:
                why = dict(decision.passed_over).get(preferred.name, "it was not chosen")
                raise BackendUnavailableError(
                    f"strict=True: {preferred.name}, the preferred FP8 backend on {device.describe()}, "
                    f"cannot run {op} with recipe {opts.recipe!r}: {why}"
                )
        figures = self_check(decision.backend, op, decision.recipe, device)
        if figures:
            logger.info("titan-primus: %s %s self-check against the emulation: %s", decision.backend_name, op, figures)
        return decision

    def _skip_reason(
        self, fqn: str, decision: RoutingDecision | None, op: Op, k: int, n: int
    ) -> tuple[KeptBecause, str] | None:
        matched = [f for f in self.options.filter_fqns if f in fqn]
        if matched:
            return "filter_fqns", f"matches filter_fqns entry {matched[0]!r}"
        if decision is None:
            return "no_backend", self._unroutable[op]
        if op == "linear" and self.options.auto_filter_small_kn and too_small_for_fp8(self.options.recipe, k, n):
            return "auto_filter_small_kn", f"too small to gain from FP8 (K={k}, N={n}; auto_filter_small_kn)"
        supported = decision.backend.supports(op, self.options.recipe, self.device, k=k, n=n)
        return None if supported else ("unsupported", supported.reason)
