"""The environment every diagnostic reports and routes by: versions of the stack (from package
metadata, so nothing optional is imported), the device profile a run names or detects, why a
backend cannot run an op, each registered backend's state, the routing table ``backend="auto"``
gives, and the route each kind of attention layer gets (:func:`diagnose`, what ``titan-primus
doctor`` renders). Every check is guarded: a failing one is a row, never an exception."""

from __future__ import annotations

import platform
from datetime import UTC, datetime

import torch

from .. import __version__, registry
from ..integrations.torchtitan import line_seams
from ..integrations.torchtitan.common.imports import installed_version, unsupported_torchtitan
from ..attention import AttentionSite, backend_route, route_attention
from ..backends.base import OPS
from ..device import DeviceProfile, detect_device, device_profile
from ..recipes import RECIPE_NAMES
from ..routing import BackendUnavailableError, select_backend
from .records import Environment
from ..self_check import Fp8SelfCheckError, attention_self_check, self_check
from .contracts import contract_states
from .results import SCHEMA_VERSION

__all__ = [
    "ATTENTION_RECIPE",
    "describe_error",
    "diagnose",
    "environment",
    "failed_check",
    "profile_dict",
    "resolve_profile",
    "versions",
    "why_not",
]

# Distribution names as pip knows them (metadata lookups normalise - and _).
_PACKAGES = ("torch", "torchtitan", "torchao", "primus-turbo")


def versions() -> dict[str, str | None]:
    """Installed versions (None when absent), and the GPU runtime torch was built for."""
    found = {"python": platform.python_version(), "titan-primus": __version__}
    found.update({name: installed_version(name) for name in _PACKAGES})
    found["torch HIP build"] = torch.version.hip
    found["torch CUDA build"] = torch.version.cuda
    return found


def why_not(backend, op: str, recipe: str, profile: DeviceProfile, k: int | None = None, n: int | None = None) -> str:
    """Why ``backend`` cannot run ``op`` with ``recipe`` on ``profile`` ("" when it can)."""
    available = backend.availability(profile)
    if not available:
        return f"unavailable: {available.reason}"
    supported = backend.supports(op, recipe, profile, k=k, n=n)
    return "" if supported else f"unsupported: {supported.reason}"


ATTENTION_RECIPE = "fp8_blockwise64"
"""FP8 attention's one definition (``Float8QuantConfig(BLOCKWISE, block_size=64)``): the recipe
field of parity's and bench's FP8 attention rows."""


def describe_error(e: Exception) -> str:
    """An exception in one line, for a report row."""
    lines = str(e).splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def resolve_profile(name: str | None) -> DeviceProfile:
    """The detected profile, or the named one; naming this machine's own arch gives the detected one."""
    detected = detect_device()
    return detected if name in (None, detected.arch) else device_profile(name)


def profile_dict(profile: DeviceProfile) -> dict:
    return {
        "kind": profile.kind,
        "arch": profile.arch,
        "name": profile.name,
        "e4m3": str(profile.e4m3).removeprefix("torch."),
        "e5m2": str(profile.e5m2).removeprefix("torch."),
        "fp8_hardware": profile.fp8_hardware,
        "mi300_class": profile.mi300_class,
        "detected": profile.detected,
        "description": profile.describe(),
    }


def environment(profile: DeviceProfile) -> dict:
    """The environment block of every results file: when, with what, on which device profile."""
    return Environment(
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        host=platform.node(),
        platform=platform.platform(),
        gpus_visible=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        versions=versions(),
        device=profile_dict(profile),
    ).to_json()


def failed_check(e: Exception) -> str:
    # doctor reports and never fails: a check that raises (a broken or renamed upstream) is a row.
    return f"doctor's check raised {describe_error(e)}"


def _backends(profile: DeviceProfile) -> list[dict]:
    rows = []
    for backend in registry.backends().values():
        row = {"name": backend.name, "provided_by": type(backend).__module__}
        try:
            verdict = backend.availability(profile)
            row.update(rank=backend.rank(profile), available=verdict.ok, reason=verdict.reason)
        except Exception as e:
            row.update(rank=None, available=False, reason=failed_check(e))
        rows.append(row)
    return rows


def _routing(profile: DeviceProfile) -> list[dict]:
    rows = []
    for op in OPS:
        for recipe in RECIPE_NAMES:
            try:
                decision = select_backend(op, recipe, profile)
            except Exception as e:
                unavailable = isinstance(e, BackendUnavailableError)
                rows.append(
                    {
                        "op": op,
                        "recipe": recipe,
                        "backend": None,
                        "definition": None,
                        "reason": str(e) if unavailable else failed_check(e),
                        "passed_over": [{"backend": n, "reason": why} for n, why in e.passed_over]
                        if unavailable
                        else [],
                        "expert_parallel": None,
                        "fp8_dispatch": None,
                    }
                )
                continue
            rows.append(
                {
                    "op": op,
                    "recipe": recipe,
                    "backend": decision.backend_name,
                    "definition": decision.recipe.definition,
                    "reason": decision.reason,
                    "passed_over": [{"backend": name, "reason": why} for name, why in decision.passed_over],
                    "expert_parallel": decision.recipe.expert_parallel_scope() if op == "grouped_mm" else None,
                    "fp8_dispatch": _fp8_dispatch(decision.recipe) if op == "grouped_mm" else None,
                }
            )
    return rows


def _fp8_dispatch(recipe) -> str:
    """What the fp8_dispatch option does for ``recipe``'s routed tokens under expert parallelism."""
    refusal = recipe.fp8_dispatch_refusal
    return f"in the activations' dtype: {refusal}" if refusal else "in FP8 (payload + scales of its activation cast)"


# The attention layers TorchTitan's language models have, as the adapters read them (the head
# dims of Llama3-8B's GQA; deepseek_v3's MLA is (192, 128)).
ATTENTION_KINDS = {
    "causal (0.2.x SDPA, 0.3 ScaledDotProductAttention)": AttentionSite(causal=True, head_dims=(128, 128)),
    "document-causal (0.3 varlen / flex, 0.2.x varlen)": AttentionSite(documents=True, head_dims=(128, 128)),
    "document-causal, sliding window 128 (0.3 varlen)": AttentionSite(documents=True, window=(127, 0)),
    "flex with masks of the model's own (0.2.x flex, gpt_oss)": AttentionSite(
        unmappable="a BlockMask cannot be read back into what Primus-Turbo takes"
    ),
}


def _attention(profile: DeviceProfile) -> list[dict]:
    """Each kind of attention layer with ``attention`` and ``fp8_attention`` on: its route."""
    rows = []
    for kind, site in ATTENTION_KINDS.items():
        try:
            route = route_attention(kind, site, device=profile, backend="auto", bf16=True, fp8=True)
        except Exception as e:
            rows.append({"layer": kind, "backend": None, "fp8": False, "reason": failed_check(e)})
            continue
        rows.append({"layer": kind, "backend": route.backend, "fp8": route.fp8, "reason": route.reason})
    return rows


def kernel_checks(profile: DeviceProfile, routing: list[dict], attention: list[dict]) -> list[dict]:
    """The numeric self-check conversion runs (titan_primus.self_check), on every routed op and
    recipe of ``routing`` and each attention kind of ``attention`` (``recipe`` fp8_blockwise64 or
    bf16): each row's ``status`` is pass, fail (the kernel computes other numbers than its
    definition, or raised), or not checked (the reference itself, or a backend that does not
    declare ``checked_at_conversion``), with the figures or the reason."""
    rows = []
    for route in routing:
        if route["backend"] is not None:
            backend = registry.get_backend(route["backend"])
            recipe = backend.recipe_for(route["recipe"], profile)
            rows.append(_kernel_check(route, backend, lambda: self_check(backend, route["op"], recipe, profile)))
    for name, fp8 in dict.fromkeys((r["backend"], r["fp8"]) for r in attention if r["backend"] is not None):
        row = {"op": "attention", "recipe": "fp8_blockwise64" if fp8 else "bf16", "backend": name}
        route = backend_route("doctor", name, fp8=fp8, device=profile, reason="--check-kernels")
        rows.append(_kernel_check(row, registry.get_backend(name), lambda: attention_self_check(route, profile)))
    return rows


def _kernel_check(route: dict, backend, check) -> dict:
    row = {"op": route["op"], "recipe": route["recipe"], "backend": route["backend"]}
    try:
        figures = check()
    except Exception as e:  # doctor reports; a failing check is a row
        row.update(status="fail", result=str(e) if isinstance(e, Fp8SelfCheckError) else failed_check(e))
    else:
        checked = "pass" if figures and not figures.startswith("not run") else "not checked"
        why = "the exact reference itself" if backend.reference else "its kernels do not declare checked_at_conversion"
        row.update(status=checked, result=figures or why)
    return row


def diagnose(device: str | None = None, check_kernels: bool = False) -> dict:
    """Everything doctor reports, as data; ``device`` names a profile (default: detected);
    ``check_kernels`` adds the numeric self-check of every routed op (:func:`kernel_checks`)."""
    profile = resolve_profile(device)
    turbo = registry.backends().get("primus_turbo")
    try:
        available = turbo.availability(profile) if turbo else None
        turbo_state = available.reason if turbo else "no primus_turbo backend is registered"
        paths = turbo.execution_paths() if available else None
    except Exception as e:
        turbo_state, paths = failed_check(e), None
    result = {
        "schema_version": SCHEMA_VERSION,
        "kind": "doctor",
        "environment": environment(profile),
        "primus_turbo": turbo_state,
        # The refusal the TorchTitan adapters raise on a line none of them supports yet, or None.
        "torchtitan_unsupported": unsupported_torchtitan(),
        # Which Primus-Turbo entry points each op runs through, eager and under torch.compile.
        "primus_turbo_paths": paths,
        "backends": _backends(profile),
        "routing": _routing(profile),
        "attention": _attention(profile),
        "torchtitan_seams": torchtitan_seams(),
        # Every upstream symbol titan-primus declares, checked against what is installed here.
        "contracts": contract_states(),
    }
    if check_kernels:
        result["kernel_checks"] = kernel_checks(profile, result["routing"], result["attention"])
    return result


def torchtitan_seams() -> list[dict]:
    """Every patch titan-primus makes to the installed TorchTitan line's internals, with whether its
    target is there (empty without a supported TorchTitan). Imports the targets' modules."""
    _, seams = line_seams()
    return [seam.row() for seam in seams]
