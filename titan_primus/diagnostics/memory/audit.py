"""What ``titan-primus bench --memory`` reports: what each backend's converted layer keeps from forward to
backward, and what that makes of a model's memory per rank under FSDP2.

1. The per-layer audit (measured, :func:`titan_primus.diagnostics.memory.saved.audit_layer`): for every available
   backend and recipe, a linear and a grouped GEMM, eager and under ``torch.compile``, with the
   weight as FSDP2 hands it over (bf16, or all-gathered in FP8 where that is exact): the bytes of
   FP8 and other activations, parameter storage (FSDP-managed) and weight copies kept.
2. Estimates for Llama3-8B/70B/405B and DeepSeek-V3-671B (a MODEL, :mod:`.memory_model`) at a
   chosen FSDP degree, sequence length and local batch, per audited backend and recipe, beside
   bf16 and TorchAO's Float8Linear (the ``torchao`` backend's rows) on the same shapes.
3. On a GPU: the peak memory of a few converted blocks under FSDP2, measured
   (``torch.cuda.max_memory_allocated``), beside the same blocks in bf16.
4. What each attention path keeps for backward per layer (a MODEL, :func:`.memory_model.attention_rows`),
   the emulated FP8 attention's row checked against the tensors it saves on a small shape.
"""

from __future__ import annotations

import math
import socket
import time
from collections import Counter

import torch
import torch.nn.functional as F

from ... import registry
from ...attention import attend, backend_route
from ...backends.base import OPS
from ...device import DeviceProfile
from ...fsdp_fp8 import fp8_all_gather_plan
from ...routing import select_backend
from ..environment import describe_error, environment, why_not
from ..model_shapes import AttentionHeads
from ..records import GpuPeakRow, MemoryRow
from ..results import document
from .model import (
    ASSUMPTIONS,
    ATTENTION_PATHS,
    BF16,
    GemmMemory,
    attention_rows,
    attention_saved,
    estimate_rows,
    selective_ac_rows,
)
from .saved import AUDIT_SHAPES, audit_layer, recording_saved_tensors

__all__ = [
    "ATTENTION_AUDIT_HEADS",
    "attention_check",
    "audit_rows",
    "blocks_peak",
    "emulated_attention_saved",
    "gemm_memory_columns",
    "gpu_peak_rows",
    "memory_document",
]

PATHS = ("eager", "compiled")


def _row(backend: str, recipe: str, op: str, path: str, all_gather: bool) -> dict:
    shape = AUDIT_SHAPES[op]
    return {
        "op": op,
        "case": f"{path}{', FP8 all-gather' if all_gather else ''}",
        "shape": shape.describe(),
        "backend": backend,
        "recipe": recipe,
        "definition": None,
        "path": path,
        "fp8_all_gather": all_gather,
        "status": "skipped",
        "reason": "",
        "kept": None,
        "kept_bytes": None,
        "input_by_reference": None,
    }


def audit_rows(profile: DeviceProfile, recipes: list[str], paths=PATHS) -> list[dict]:
    """One row per backend x op x recipe x path x (bf16 / FP8 all-gather) on ``profile``."""
    rows = []
    for backend in registry.backends().values():
        for op in OPS:
            shape = AUDIT_SHAPES[op]
            for recipe in recipes:
                reason = why_not(backend, op, recipe, profile, k=shape.k, n=shape.n)
                resolved = (
                    None if reason else select_backend(op, recipe, profile, backend.name, k=shape.k, n=shape.n).recipe
                )
                for path in paths:
                    for all_gather in (False, True):
                        row = _row(backend.name, recipe, op, path, all_gather)
                        rows.append(row)
                        row["reason"] = reason
                        if reason:
                            continue
                        row["definition"] = resolved.definition
                        if all_gather:
                            plan, verdict = fp8_all_gather_plan(backend, resolved, op)
                            if plan is None:
                                row["reason"] = f"gathered in bf16: {verdict.reason}"
                                continue
                        _audit(row, backend, resolved, op, path, all_gather)
    return rows


def _audit(row: dict, backend, recipe, op: str, path: str, all_gather: bool) -> None:
    try:
        result = audit_layer(backend, recipe, AUDIT_SHAPES[op], compiled=path == "compiled", fp8_all_gather=all_gather)
    except Exception as e:  # one backend breaking must not hide the others' figures
        row.update(status="error", reason=describe_error(e))
        return
    kept = result["kept"]
    row.update(
        status="ok",
        kept=kept,
        kept_bytes=sum(v for k, v in kept.items() if k != "parameter"),
        input_by_reference=result["input_by_reference"],
    )


def _gemm_memory(row: dict) -> GemmMemory:
    """Per-element figures of one audited GEMM (a bf16-weight row, or an FP8 all-gather row)."""
    shape = AUDIT_SHAPES[row["op"]]
    kept = row["kept"]
    inputs = shape.rows * shape.k
    activations = kept["activation_fp8"] + kept["activation_hp"] + kept["other"]
    if row["input_by_reference"]:
        activations -= 2 * inputs  # the bf16 input itself, counted once per group of GEMMs reading it
    weight = shape.k * shape.n * (len(shape.groups) or 1)
    gathered = {}
    if row["fp8_all_gather"]:  # one byte per element, and what the scales add per row
        gathered = {"gathered_bytes": 1.0, "gathered_row_bytes": (kept["parameter"] - weight) / (weight // shape.k)}
    return GemmMemory(
        input_bytes=activations / inputs,
        input_by_reference=row["input_by_reference"],
        weight_copy_bytes=kept["weight_copy"] / weight,
        **gathered,
    )


def gemm_memory_columns(rows: list[dict]) -> dict[str, dict[bool, GemmMemory | None]]:
    """The estimates' columns: bf16, and each audited backend and recipe (its compiled rows
    where they ran, else eager), with the weights gathered in bf16, and in FP8 where audited so,
    as {routed grouped GEMM?: GemmMemory}. A grouped GEMM without an FP8 all-gather row keeps
    its bf16-gather figures in the FP8-gather column (its weights then gather in bf16)."""
    ok = {(r["backend"], r["recipe"], r["op"], r["path"], r["fp8_all_gather"]): r for r in rows if r["status"] == "ok"}
    columns: dict[str, dict[bool, GemmMemory | None]] = {"bf16": {False: BF16, True: BF16}}
    for backend, recipe in dict.fromkeys((r["backend"], r["recipe"]) for r in ok.values()):
        path = "compiled" if (backend, recipe, "linear", "compiled", False) in ok else "eager"
        linear = ok.get((backend, recipe, "linear", path, False))
        if linear is None:
            continue
        name = f"{backend} {recipe} ({linear['definition']} definition, {path}"
        for gather in (False, True):
            if gather and (backend, recipe, "linear", path, True) not in ok:
                continue
            memory = {}
            for routed, op in ((False, "linear"), (True, "grouped_mm")):
                row = ok.get((backend, recipe, op, path, gather)) or ok.get((backend, recipe, op, path, False))
                memory[routed] = row and _gemm_memory(row)
            columns[f"{name}, {'FP8' if gather else 'bf16'} all-gather)"] = memory
    return columns


# --- the attention model, checked against the emulation's saved tensors ---------------------

# DeepSeek-V3's kind (MLA: v's head dim below q/k's, as many kv heads as q heads), which FP8
# attention runs; GQA with unequal head dims is refused (fp8_attention_refusal), on every call too.
ATTENTION_AUDIT_HEADS = AttentionHeads(heads=4, kv_heads=4, head_dim=96, v_head_dim=32)
ATTENTION_AUDIT_SEQ = 192


def emulated_attention_saved(profile: DeviceProfile) -> list[tuple[tuple[int, ...], int]]:
    """(shape, bytes per element) of each tensor the emulated FP8 attention saves for backward
    on :data:`ATTENTION_AUDIT_HEADS`, batch 1, measured (``saved_tensors_hooks``)."""
    h, S = ATTENTION_AUDIT_HEADS, ATTENTION_AUDIT_SEQ
    dims = ((h.heads, h.head_dim), (h.kv_heads, h.head_dim), (h.kv_heads, h.v_head_dim))
    q, k, v = (torch.randn(1, S, n, d, dtype=torch.bfloat16, requires_grad=True) for n, d in dims)
    reference = registry.reference_backend().name  # the exact emulation: its saved tensors are the definition's
    route = backend_route("memory audit", reference, fp8=True, device=profile, reason="bench --memory")
    with recording_saved_tensors() as saved:
        attend(route, q, k, v, scale=None, causal=True)
    return sorted((tuple(t.shape), t.element_size()) for t in saved)


def attention_check(profile: DeviceProfile) -> dict:
    """The emulated FP8 attention's modelled saved tensors against those it saves."""
    model = attention_saved(ATTENTION_PATHS[3], ATTENTION_AUDIT_HEADS, ATTENTION_AUDIT_SEQ, 1)
    modelled = sorted((t.shape, t.element_bytes) for t in model)
    measured = emulated_attention_saved(profile)
    h = ATTENTION_AUDIT_HEADS
    return {
        "path": ATTENTION_PATHS[3],
        "shape": f"B=1 S={ATTENTION_AUDIT_SEQ} Hq={h.heads} Hkv={h.kv_heads} D={h.head_dim} Dv={h.v_head_dim} causal",
        "modelled_bytes": sum(t.bytes for t in model),
        "measured_bytes": sum(math.prod(shape) * size for shape, size in measured),
        "modelled_tensors": [{"shape": list(shape), "element_bytes": size} for shape, size in modelled],
        "measured_tensors": [{"shape": list(shape), "element_bytes": size} for shape, size in measured],
        "equal": modelled == measured,
    }


# --- measured on a GPU: a few converted blocks under FSDP2 -----------------------------------


class _Block(torch.nn.Module):
    """x + w2(gelu(w1(x))): two GEMMs of Llama3-8B's FFN shapes."""

    def __init__(self, dim: int, hidden: int, linear, device):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(hidden, dim, device=device) * 0.02)
        self.w2 = torch.nn.Parameter(torch.randn(dim, hidden, device=device) * 0.02)
        self.linear = linear

    def forward(self, x):
        return x + self.linear(F.gelu(self.linear(x, self.w1)), self.w2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def blocks_peak(
    linear, device: torch.device, blocks: int = 4, dim: int = 4096, hidden: int = 14336, tokens: int = 8192
) -> int | None:
    """Peak bytes allocated beyond the sharded model during one forward + backward of ``blocks``
    blocks under FSDP2 (one rank; bf16 parameters; every block resharded after its forward), on
    ``device``; None where the device reports no allocator peak (a CPU: the run still checks the
    path works). Starts (and ends) a one-rank process group if none is running."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    started = not dist.is_initialized()
    if started:
        backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(*(_Block(dim, hidden, linear, device) for _ in range(blocks)))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model:
            fully_shard(block, mp_policy=mp, reshard_after_forward=True)
        fully_shard(model, mp_policy=mp)
        x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
        on_gpu = device.type == "cuda"
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        model(x).float().pow(2).mean().backward()
        if not on_gpu:
            return None
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    finally:
        if started:
            dist.destroy_process_group()


def gpu_peak_rows(profile: DeviceProfile, recipes: list[str]) -> list[dict]:
    """On a GPU: the blocks' peak in bf16 and with each backend's FP8 linear."""
    device = torch.device("cuda")
    rows = [
        {
            "backend": "bf16",
            "recipe": None,
            "status": "ok",
            "reason": "",
            "peak_bytes": blocks_peak(lambda x, w: F.linear(x, w), device),
        }
    ]
    for backend in registry.backends().values():
        for recipe in recipes:
            row = {
                "backend": backend.name,
                "recipe": recipe,
                "status": "skipped",
                "peak_bytes": None,
                "reason": why_not(backend, "linear", recipe, profile, k=4096, n=14336),
            }
            rows.append(row)
            if row["reason"]:
                continue
            decision = select_backend("linear", recipe, profile, backend.name, k=4096, n=14336)
            try:
                row["peak_bytes"] = blocks_peak(lambda x, w, d=decision: d.backend.linear(x, w, None, d.recipe), device)
                row["status"] = "ok"
            except Exception as e:
                row.update(status="error", reason=describe_error(e))
    for row in rows[1:]:
        if row["status"] == "ok" and rows[0]["peak_bytes"]:
            row["vs_bf16"] = row["peak_bytes"] / rows[0]["peak_bytes"]
    return rows


def memory_document(
    profile: DeviceProfile, recipes: list[str], quick: bool, fsdp_ranks: int, seq_len: int, local_batch: int
) -> dict:
    """Everything ``bench --memory`` reports, as its results document (kind "memory"): the audit
    rows, the estimates, the GPU peaks (on a detected GPU), selective AC and attention rows, and
    the attention check; the summary counts a failed check as an error."""
    paths = ("eager",) if quick else PATHS
    started = time.perf_counter()
    rows = audit_rows(profile, recipes, paths)
    estimates = estimate_rows(gemm_memory_columns(rows), fsdp_ranks, seq_len, local_batch)
    gpu = gpu_peak_rows(profile, recipes) if torch.cuda.is_available() and profile.detected else None
    attention = attention_rows(seq_len, local_batch)
    checked = attention_check(profile)
    settings = {
        "recipes": recipes,
        "quick": quick,
        "paths": list(paths),
        "fsdp_ranks": fsdp_ranks,
        "seq_len": seq_len,
        "local_batch": local_batch,
        "assumptions": ASSUMPTIONS,
        "shapes": {op: s.describe() for op, s in AUDIT_SHAPES.items()},
    }
    counts = Counter(r["status"] for r in rows)
    counts["error"] += not checked["equal"]
    summary = {status: counts[status] for status in ("ok", "error", "skipped")}
    summary["seconds"] = round(time.perf_counter() - started, 2)
    doc = document(
        "memory", environment(profile), settings, [MemoryRow.from_fields(r).to_json() for r in rows], summary
    )
    doc["estimates"] = estimates
    doc["selective_ac"] = selective_ac_rows(seq_len, local_batch)
    doc["gpu_peak"] = None if gpu is None else [GpuPeakRow.from_fields(r).to_json() for r in gpu]
    doc["attention"] = attention
    doc["attention_check"] = checked
    return doc
