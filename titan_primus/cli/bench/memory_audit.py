"""``titan-primus bench --memory``, rendered: the document :mod:`titan_primus.diagnostics.memory.audit`
computes (what each backend's converted layer keeps for backward, the per-model estimates, GPU
peaks, attention) as tables."""

from __future__ import annotations

import sys
from collections import Counter

from ...device import DeviceProfile
from ...diagnostics.environment import resolve_profile
from ...diagnostics.memory.audit import memory_document
from ...diagnostics.memory.saved import AUDIT_SHAPES, CATEGORIES
from ...diagnostics.results import prepare_output
from ..formatting import column_table, emit, fields, number, outcome_lines

__all__ = ["render", "run"]


def _gib(value: float) -> str:
    return f"{value / 2**30:.1f}"


def _mib(value: float) -> str:
    return f"{value / 2**20:.2f}"


def _kept(category: str):
    return lambda r: number(r["kept"] and r["kept"][category], ",")


_SAVED_COLUMNS = (
    *fields("op", "backend", "recipe"),
    ("definition", lambda r: r["definition"] or "-"),
    ("path", lambda r: r["case"]),
    *zip(("FP8 activations", "other activations", "parameter", "weight copies", "other"), map(_kept, CATEGORIES)),
    (
        "input kept itself",
        lambda r: "yes" if r["input_by_reference"] else "-" if r["input_by_reference"] is None else "no",
    ),
    *fields("status"),
)
_ESTIMATE_COLUMNS = (
    *fields("model", "column"),
    ("sharded state", lambda e: _gib(e["state_bytes"])),
    ("gathered", lambda e: _gib(e["gathered_bytes"])),
    ("GEMM activations", lambda e: _gib(e["gemm_activation_bytes"])),
    ("weight copies", lambda e: _gib(e["weight_copy_bytes"])),
    ("total, no AC", lambda e: _gib(e["total_no_ac_bytes"])),
    ("total, full AC", lambda e: _gib(e["total_full_ac_bytes"])),
)
_SELECTIVE_AC_COLUMNS = (
    *fields("model", "policy"),
    ("GEMM outputs kept", lambda r: _gib(r["kept_gemm_output_bytes"])),
    ("forward GEMM FLOPs recomputed", lambda r: f"{100 * r['forward_flops_recomputed']:.1f}%"),
)
_ATTENTION_COLUMNS = (
    *fields("model", "path"),
    ("q, k, v MiB", lambda r: _mib(r["qkv_bytes"])),
    ("out MiB", lambda r: _mib(r["out_bytes"])),
    ("LSE, scales MiB", lambda r: _mib(r["other_bytes"])),
    ("per layer MiB", lambda r: _mib(r["per_layer_bytes"])),
    ("x TorchTitan", lambda r: f"{r['vs_torchtitan']:.3f}"),
    *fields("layers"),
    ("all layers GiB", lambda r: _gib(r["all_layers_bytes"])),
)
_GPU_PEAK_COLUMNS = (
    *fields("backend"),
    ("recipe", lambda r: r["recipe"] or "-"),
    ("peak", lambda r: number(r["peak_bytes"], ",")),
    ("x bf16", lambda r: f"{r['vs_bf16']:.3f}" if r.get("vs_bf16") else "-"),
    *fields("status"),
)


def render(doc: dict, profile: DeviceProfile) -> str:
    """The console report of a memory document (:func:`memory_document`)."""
    rows, gpu, settings, checked = doc["results"], doc["gpu_peak"], doc["settings"], doc["attention_check"]
    shapes = ", ".join(f"{op} {s.describe()}" for op, s in AUDIT_SHAPES.items())
    ran = [r for r in rows if r["status"] != "skipped"]
    copies = sorted(
        {f"{r['backend']} {r['recipe']} {r['op']} {r['case']}" for r in ran if r["kept"] and r["kept"]["weight_copy"]}
    )
    lines = [
        f"titan-primus bench --memory on {profile.describe()}",
        f"bytes a converted layer keeps from forward to backward (torch.autograd.graph.saved_tensors_hooks), "
        f"bf16 input and weight; {shapes}",
        "parameter = the weight's own storage or its FSDP2-gathered FP8 payload (FSDP-managed: freed after the "
        "forward, gathered again for backward); weight copies = other weight-shaped storage (under FSDP2 every "
        "layer's stays resident)",
        "",
        column_table(_SAVED_COLUMNS, ran),
        *outcome_lines(rows, "audits", lambda r: f"{r['op']} {r['backend']} {r['recipe']} {r['case']}"),
        "",
        f"weight copies kept for backward: {len(copies)} of {len(ran)} audited cases"
        + (f" ({'; '.join(copies)})" if copies else ""),
        "",
        f"Memory per rank, GiB: {settings['assumptions']}. FSDP degree {settings['fsdp_ranks']}, sequence "
        f"{settings['seq_len']}, local batch {settings['local_batch']}; each backend and recipe with "
        f"its weights all-gathered in bf16, and in FP8 (enable_fsdp_float8_all_gather) where exact; a "
        f"column without an audited grouped GEMM has no MoE rows.",
        column_table(_ESTIMATE_COLUMNS, doc["estimates"]),
        "",
        f"Selective activation checkpointing, MODELLED: the GEMM outputs each policy keeps in the checkpointed blocks "
        f"(GiB per rank, sequence {settings['seq_len']}, local batch {settings['local_batch']}) and the share of "
        f"their forward GEMM FLOPs it runs again in backward (docs/memory.md):",
        column_table(_SELECTIVE_AC_COLUMNS, doc["selective_ac"]),
        "",
        f"Attention: bytes each path keeps for backward per layer, MODELLED from shapes (sequence "
        f"{settings['seq_len']}, local batch {settings['local_batch']}; titan_primus/diagnostics/memory/model.py); "
        f"the emulated FP8 attention's row checked against the tensors it saves ({checked['shape']}, "
        f"saved_tensors_hooks): model {checked['modelled_bytes']:,} B, measured {checked['measured_bytes']:,} B, "
        + ("tensor for tensor equal" if checked["equal"] else "DIFFERENT (the model is wrong)"),
        column_table(_ATTENTION_COLUMNS, doc["attention"]),
        "",
    ]
    if gpu is None:
        lines.append("GPU peak memory of converted blocks under FSDP2: not measured (no GPU here)")
    else:
        lines.append(
            "GPU peak memory beyond the sharded model, 4 blocks x+w2(gelu(w1 x)) (dim 4096, hidden 14336, "
            "8192 tokens) under FSDP2 (1 rank), measured with torch.cuda.max_memory_allocated:"
        )
        lines.append(column_table(_GPU_PEAK_COLUMNS, gpu))
    counts = Counter(r["status"] for r in rows)
    lines += ["", f"{counts['ok']} audited, {counts['error']} errors in {doc['summary']['seconds']:.1f} s"]
    return "\n".join(lines) + "\n"


def run(args, recipes: list[str]) -> int:
    """``bench --memory`` of ``recipes``; 1 when an audit raised."""
    profile = resolve_profile(args.device)
    prepare_output(args.json)
    doc = memory_document(profile, recipes, args.quick, args.fsdp_ranks, args.seq_len, args.local_batch)
    emit(sys.stdout, render(doc, profile), doc, args.json)
    return 1 if doc["summary"]["error"] else 0
