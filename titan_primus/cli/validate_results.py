"""Rendering a ``titan-primus validate`` results file: Markdown (the verdicts with their figures,
the runs, the floors, the stack and what changed since the baseline) and a PNG (per config: the
loss curves of bf16, FP8 and the baseline's FP8; tokens/s; peak memory)."""

from __future__ import annotations

import math

from ..diagnostics.validate.verdicts import median_tps, peak_memory
from .formatting import column_table, markdown_table, pyplot, save_png

__all__ = ["plot_validate_png", "render_validate_markdown"]


def _pct(x) -> str:
    x = float(x) if x is not None else math.nan
    return "nan" if math.isnan(x) else f"{100 * x:.3g}%"


def _last_loss(steps: list[dict]) -> str:
    return f"{float(steps[-1]['loss']):.4f}" if steps else "-"


_RUN_COLUMNS = (
    ("run", lambda r: r["role"]),
    ("seed", lambda r: str(r["seed"]) + (" + last bit" if r.get("last_bit") else "")),
    ("steps", lambda r: str(len(r["steps"]))),
    ("last loss", lambda r: _last_loss(r["steps"])),
    ("tokens/s (median)", lambda r: f"{median_tps(r['steps']):,.0f}" if r["steps"] else "-"),
    ("peak memory GiB", lambda r: f"{peak_memory(r['steps']) / 2**30:.3f}" if r["steps"] else "-"),
    ("wall s", lambda r: f"{r.get('wall_s', '-')}"),
    ("status", lambda r: r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')}"),
)


def render_validate_markdown(doc: dict, label: str) -> str:
    env, settings, summary = doc["environment"], doc["settings"], doc["summary"]
    out = [f"# titan-primus validate: {summary['status'].upper()} ({label})", ""]
    out.append(f"`{settings['command']}`, {summary.get('wall_s', '?')} s")
    out.append("")
    stack = [[k, str(v) if v is not None else "-"] for k, v in env.get("versions", {}).items()]
    stack += [["device", env.get("device", {}).get("description", "-")], ["device name", env.get("device_name", "-")]]
    stack += [["Primus-Turbo build", env.get("primus_turbo_build") or "-"], ["date", env.get("date", "-")]]
    out += [markdown_table(["stack", ""], stack), ""]
    baseline = doc.get("baseline")
    if baseline:
        out += [f"## Since the baseline {baseline['path']} ({baseline.get('date', '?')})", ""]
        diffs = baseline["stack_differences"]
        out.append(
            markdown_table(
                ["stack field", "baseline", "now"], [[d["field"], str(d["baseline"]), str(d["now"])] for d in diffs]
            )
            if diffs
            else "The stack is the same as the baseline's."
        )
        allowed = baseline.get("allowed_differences") or []
        if allowed:
            out += ["", "Settings that differ from the baseline's, allowed by --allow-mismatch:", ""]
            out.append(
                markdown_table(
                    ["setting", "config", "baseline", "now"],
                    [[d["field"], d["config"], str(d["baseline"]), str(d["now"])] for d in allowed],
                )
            )
        out.append("")
    for result in doc["results"]:
        out += [f"## {result['config']} ({result['module']}; FP8: titan_primus {result['fp8_config']})", ""]
        runs = [{"role": role, **run} for role, run in result["runs"].items()]
        out += [column_table(_RUN_COLUMNS, runs), ""]
        floors = result.get("floors", {})
        if floors:
            rows = [
                [
                    key,
                    *(
                        f"{_pct(f[key]['final'])} / {_pct(f[key]['curve'])}"
                        for f in (floors["seed"], floors["last_bit"])
                    ),
                    f"{_pct(result['gaps']['fp8_vs_bf16'][key]['final'])} / {_pct(result['gaps']['fp8_vs_bf16'][key]['curve'])}",
                ]
                for key in floors["seed"]
            ]
            out.append("Gaps between windowed means (last window / worst window):")
            out += ["", markdown_table(["curve", "seed floor", "last-bit floor", "FP8 vs bf16"], rows), ""]
        out.append(
            markdown_table(
                ["verdict", "status", "figures"],
                [[v["name"], v["status"].upper(), v["text"]] for v in result["verdicts"]],
            )
        )
        if result.get("routing"):
            out += ["", "```", result["routing"], "```"]
        out.append("")
    failed = summary.get("failed_verdicts", [])
    out.append(
        f"{summary['verdicts'] - summary['failed']} of {summary['verdicts']} verdicts pass"
        + (f"; FAILED: {'; '.join(failed)}" if failed else "")
    )
    return "\n".join(out) + "\n"


_STYLE = {"bf16": ("C0", "-"), "fp8": ("C3", "-"), "seed_floor": ("C0", ":"), "last_bit_floor": ("C3", ":")}


def plot_validate_png(labelled: list[tuple[str, dict]], path: str) -> None:
    """One row per config of every file: loss curves (with the baseline's FP8 and bf16 dashed),
    tokens/s per step, and peak memory per run."""

    plt = pyplot()
    rows = [(label, doc, result) for label, doc in labelled for result in doc["results"]]
    fig, axes = plt.subplots(len(rows), 3, figsize=(16, 4 * len(rows)), squeeze=False)
    for (label, doc, result), (loss_ax, tps_ax, mem_ax) in zip(rows, axes):
        bars = []  # (run, peak GiB, colour)
        baseline_runs = ((result.get("baseline") or {}).get("runs") or {}).items()
        curves = [(role, run, *_STYLE.get(role, ("C7", "-")), 1.0) for role, run in result["runs"].items()]
        curves += [(f"baseline {role}", run, _STYLE[role][0], "--", 0.6) for role, run in baseline_runs]
        for name, run, color, style, alpha in curves:
            steps = run["steps"]
            if not steps:
                continue
            xs = [s["step"] for s in steps]
            loss_ax.plot(xs, [float(s["loss"]) for s in steps], style, color=color, lw=1, alpha=alpha, label=name)
            tps_ax.plot(xs, [float(s["tps"]) for s in steps], style, color=color, lw=1, alpha=alpha, label=name)
            bars.append((name, peak_memory(steps) / 2**30, color))
        title = f"{result['config']} ({label}): {doc['summary']['status']}"
        loss_ax.set_title(f"loss: {title}", fontsize=9)
        tps_ax.set_title("tokens/s per step", fontsize=9)
        for ax in (loss_ax, tps_ax):
            ax.set_xlabel("step")
            if ax.lines:  # a run that logged no step draws nothing
                ax.legend(fontsize=7)
        mem_ax.barh(range(len(bars)), [peak for _, peak, _ in bars], color=[color for _, _, color in bars])
        mem_ax.set_yticks(range(len(bars)), [name for name, _, _ in bars], fontsize=7)
        mem_ax.invert_yaxis()
        device = "peak RSS" if doc["environment"].get("gpus_visible", 0) == 0 else "peak device memory"
        mem_ax.set_title(f"memory: {device}, GiB", fontsize=9)
    save_png(plt, fig, path)
