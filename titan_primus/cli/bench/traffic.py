"""``titan-primus bench``'s traffic tables, rendered: FSDP2 all-gather bytes per step with and
without FP8 weight all-gather, and expert-parallel all-to-all bytes with and without FP8 token
dispatch (models computed by :mod:`titan_primus.diagnostics.traffic`)."""

from __future__ import annotations

from ...diagnostics.traffic.ep import MODEL, TOKENS_PER_RANK, ep_traffic_rows
from ...diagnostics.traffic.fsdp import traffic_rows
from ..formatting import markdown_table

__all__ = ["render_ep_traffic", "render_traffic"]


def render_traffic(ranks: int) -> str:
    gib = 2**30
    table = [
        [
            r["model"],
            f"{100 * r['fp8_gathered_share']:.1f}%",
            f"{r['bf16_bytes'] / gib:.1f}",
            f"{r['tensorwise_bytes'] / gib:.1f} ({r['tensorwise_ratio']:.3f}x)",
            f"{r['rowwise_bytes'] / gib:.1f} ({r['rowwise_ratio']:.3f}x)",
        ]
        for r in traffic_rows(ranks)
    ]
    return (
        "\n".join(
            [
                f"FSDP2 all-gather traffic per step and rank on {ranks} ranks (MODEL, computed from shapes; "
                f"see titan_primus/diagnostics/traffic/fsdp.py), GiB:",
                "rowwise applies to the Primus-Turbo v0.3.1+ definition only; other rowwise definitions gather in bf16",
                markdown_table(["model", "params FP8-gathered", "bf16", "FP8 tensorwise", "FP8 rowwise"], table),
            ]
        )
        + "\n"
    )


def render_ep_traffic(tokens_per_rank: int = TOKENS_PER_RANK) -> str:
    gib = 2**30
    table = [
        [
            f"EP {r['ep']}",
            f"{r['bf16_dispatch_bytes'] / gib:.2f}",
            f"{r['rowwise_dispatch_bytes'] / gib:.2f} ({r['rowwise_dispatch_ratio']:.3f}x)",
            f"{r['mxfp8_dispatch_bytes'] / gib:.2f} ({r['mxfp8_dispatch_ratio']:.3f}x)",
            f"{r['bf16_step_bytes'] / gib:.2f}",
            f"{r['rowwise_step_ratio']:.3f}x / {r['mxfp8_step_ratio']:.3f}x",
        ]
        for r in ep_traffic_rows(tokens_per_rank)
    ]
    headers = [
        "degree",
        "dispatch bf16",
        "dispatch FP8 rowwise",
        "dispatch FP8 mxfp8",
        "all 4 bf16",
        "all 4, FP8 dispatch",
    ]
    return (
        "\n".join(
            [
                f"Expert-parallel all-to-all traffic per step and rank, {MODEL}, {tokens_per_rank} tokens per rank, "
                f"uniform routing (MODEL, computed from shapes; see titan_primus/diagnostics/traffic/ep.py), GiB sent:",
                "FP8 dispatch (fp8_dispatch) changes the forward dispatch only; combine and both gradients stay bf16",
                markdown_table(headers, table),
            ]
        )
        + "\n"
    )
