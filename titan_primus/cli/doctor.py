"""``titan-primus doctor``: what this machine has and what would run where.

Versions of the stack, the device profile, every registered backend (plugins included) with
whether it is available and why not, and the routing table ``backend="auto"`` gives for each op
and recipe. It reports and never fails: exit code 0 even where no FP8 backend is available; with
``--check-kernels`` (the numeric self-check of every routed op), 1 when a kernel failed it.
Versions come from package metadata; of the optional packages only TorchTitan's modules that
titan-primus patches are imported, to say whether each patch's target is there.
"""

from __future__ import annotations

import json
import sys
from collections import Counter

from ..backends.primus_turbo.release import describe_build
from ..device import known_profiles
from ..diagnostics.environment import diagnose
from .arguments import add_profile, add_switch
from .formatting import column_table, fields, markdown_table

__all__ = ["register", "render", "run"]


_BACKEND_COLUMNS = (
    ("backend", lambda b: b["name"]),
    ("provided by", lambda b: b["provided_by"]),
    ("rank", lambda b: str(b["rank"])),
    ("available", lambda b: "yes" if b["available"] else "no"),
    ("why", lambda b: b["reason"]),
)
_ROUTING_COLUMNS = (
    *fields("op", "recipe"),
    ("backend", lambda r: r["backend"] or "NONE"),
    ("definition", lambda r: r["definition"] or "-"),
    ("why", lambda r: r["reason"] if r["backend"] else "no backend can run it here"),
)
_ATTENTION_COLUMNS = (
    ("attention layer", lambda r: r["layer"]),
    ("backend", lambda r: f"{r['backend']} ({'FP8' if r['fp8'] else 'bf16'})" if r["backend"] else "TorchTitan's own"),
)
_SEAM_COLUMNS = (
    ("seam", lambda s: s["name"]),
    ("target", lambda s: s["target"]),
    ("written for", lambda s: s["verified"]),
    ("here", lambda s: "yes" if s["present"] else f"MISSING: {s['missing']}"),
    ("why patched", lambda s: s["why"]),
)
_KERNEL_CHECK_COLUMNS = fields("op", "recipe", "backend", "status", "result")
_CONTRACT_COLUMNS = fields("upstream", "symbol", "found", "used_by", "verified")


def _version_rows(diagnosis: dict) -> list[list[str]]:
    found = diagnosis["environment"]["versions"]
    missing = {
        "torchtitan": "not installed: only the TorchTitan converter needs it; the FP8 ops and these tools run without",
        "torchao": "not installed: the torchao backend is unavailable (pip install 'torchao>=0.17')",
        "primus-turbo": "not installed",
        "torch HIP build": "-",
        "torch CUDA build": "-",
    }
    rows = [[name, version or missing.get(name, "not installed")] for name, version in found.items()]
    turbo = next(row for row in rows if row[0] == "primus-turbo")
    if found["primus-turbo"]:
        turbo[1] = describe_build(found["primus-turbo"])  # a dev build: the tag and commits it is past
    turbo[1] += f"; here: {diagnosis['primus_turbo']}"
    if diagnosis["torchtitan_unsupported"]:
        next(row for row in rows if row[0] == "torchtitan")[1] += f"; {diagnosis['torchtitan_unsupported']}"
    return rows


def render(diagnosis: dict) -> str:
    env = diagnosis["environment"]
    device = env["device"]
    lines = ["titan-primus doctor", "", markdown_table(["component", "version"], _version_rows(diagnosis)), ""]
    if diagnosis.get("primus_turbo_paths"):
        lines += [
            f"Primus-Turbo path of both ops, {mode}: {path}" for mode, path in diagnosis["primus_turbo_paths"].items()
        ]
        lines.append("")
    lines.append(f"device: {device['description']}")
    lines.append(
        f"  MI300-class: {'yes' if device['mi300_class'] else 'no'}; "
        f"FP8 matrix units: {'yes' if device['fp8_hardware'] else 'no'}; "
        f"FP8 formats: {device['e4m3']} / {device['e5m2']}; "
        f"GPUs visible to torch: {env['gpus_visible']}"
    )
    if device["kind"] == "cpu":
        lines.append(
            f'  a CPU run emulates {device["e4m3"]} (OCP, MI355X\'s gfx950): device="gfx942" (--device gfx942) '
            f"gives MI300X's float8_e4m3fnuz, for GEMMs and FP8 attention alike"
        )
    lines += ["", 'backends (backend="auto" takes the highest rank that is available and supports the op):']
    lines.append(column_table(_BACKEND_COLUMNS, diagnosis["backends"]))
    # Each backend's reason, long and the same for many rows, is listed once below the table;
    # the rows cite it by number (the JSON keeps every row's reasons in full).
    passed_over = sorted({(p["backend"], p["reason"]) for r in diagnosis["routing"] for p in r["passed_over"]})
    note = {reason: n for n, reason in enumerate(passed_over, 1)}
    lines += ["", f"routing on {device['arch']} (op x recipe -> backend; [n]: why a backend was passed over, below):"]
    passed_over_column = (
        "passed over",
        lambda r: ", ".join(f"{p['backend']} [{note[p['backend'], p['reason']]}]" for p in r["passed_over"]) or "-",
    )
    lines.append(column_table((*_ROUTING_COLUMNS, passed_over_column), diagnosis["routing"]))
    expert_parallel = [r for r in diagnosis["routing"] if r["expert_parallel"]]
    if expert_parallel:
        lines += ["", "grouped_mm under expert parallelism (what each recipe's scales cover on a rank):"]
        lines += [
            f"  {r['recipe']} ({r['backend']}, {r['definition']} definition): {r['expert_parallel']}"
            for r in expert_parallel
        ]
        lines += ["", "grouped_mm token dispatch with fp8_dispatch on (under expert parallelism):"]
        lines += [f"  {r['recipe']}: {r['fp8_dispatch']}" for r in expert_parallel]
    lines += ["", "attention layers with attention and fp8_attention on (off by default: docs/attention.md):"]
    why_column = ("why", lambda r: _cited(r["reason"], note))
    lines.append(column_table((*_ATTENTION_COLUMNS, why_column), diagnosis["attention"]))
    if diagnosis["torchtitan_seams"]:
        lines += ["", "TorchTitan internals titan-primus patches (each line's seams.py), and whether each is there:"]
        lines.append(column_table(_SEAM_COLUMNS, diagnosis["torchtitan_seams"]))
    states = Counter(c["state"] for c in diagnosis["contracts"])
    lines += ["", "upstream contracts (docs/upgrades.md) against what is installed here: "]
    lines[-1] += ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
    if states["differs"]:
        lines.append(column_table(_CONTRACT_COLUMNS, [c for c in diagnosis["contracts"] if c["state"] == "differs"]))
    if "kernel_checks" in diagnosis:
        lines += ["", "numeric self-check of each routed op against the emulation of its definition (--check-kernels):"]
        lines.append(column_table(_KERNEL_CHECK_COLUMNS, diagnosis["kernel_checks"]))
    if passed_over:
        lines += ["", "why backends were passed over:"]
        lines += [f"  [{n}] {name}: {why}" for (name, why), n in note.items()]
    return "\n".join(lines) + "\n"


def _cited(reason: str, note: dict) -> str:
    """``reason`` with any backend's long reason listed below the tables replaced by its number."""
    for (_, why), n in note.items():
        reason = reason.replace(why, f"[{n}]")
    return reason


def register(commands) -> None:
    """Adds the command's parser to ``commands`` (the subparsers of ``titan-primus``)."""
    doctor = commands.add_parser(
        "doctor",
        help="versions, device profile, backends and the routing table (always exits 0)",
        description="Report versions, the device profile, every registered backend and the op x recipe routing table.",
    )
    add_profile(doctor, f"show a named device profile instead of the detected one ({', '.join(known_profiles())})")
    add_switch(doctor, "--json", "print JSON to stdout instead of tables")
    add_switch(
        doctor,
        "--check-kernels",
        "also run the numeric self-check conversion runs on every routed op and recipe, and exit 1 if one fails",
    )
    doctor.set_defaults(run=run)


def run(args) -> int:
    """0, or with --check-kernels 1 when a routed kernel failed its self-check."""
    diagnosis = diagnose(args.device, check_kernels=args.check_kernels)
    sys.stdout.write(json.dumps(diagnosis, indent=2) + "\n" if args.json else render(diagnosis))
    return int(any(row["status"] == "fail" for row in diagnosis.get("kernel_checks", ())))
