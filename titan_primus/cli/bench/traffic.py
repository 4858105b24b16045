"""``titan-primus bench``'s traffic tables, rendered: FSDP2 all-gather bytes per step with and
without FP8 weight all-gather, and expert-parallel all-to-all bytes with and without FP8 token
dispatch (models computed by :mod:`titan_primus.diagnostics.traffic`)."""

from __future__ import annotations

from ..formatting import column_table, fields

__all__ = ["render_ep_traffic", "render_traffic"]

_GIB = 2**30
_FSDP_COLUMNS = (
    *fields("model"),
    ("params FP8-gathered", lambda r: f"{100 * r['fp8_gathered_share']:.1f}%"),
    ("bf16", lambda r: f"{r['bf16_bytes'] / _GIB:.1f}"),
    ("FP8 tensorwise", lambda r: f"{r['tensorwise_bytes'] / _GIB:.1f} ({r['tensorwise_ratio']:.3f}x)"),
    ("FP8 rowwise", lambda r: f"{r['rowwise_bytes'] / _GIB:.1f} ({r['rowwise_ratio']:.3f}x)"),
    ("FP8 blockwise", lambda r: f"{r['blockwise_bytes'] / _GIB:.1f} ({r['blockwise_ratio']:.3f}x)"),
)
_EP_COLUMNS = (
    ("degree", lambda r: f"EP {r['ep']}"),
    ("dispatch bf16", lambda r: f"{r['bf16_dispatch_bytes'] / _GIB:.2f}"),
    (
        "dispatch FP8 rowwise",
        lambda r: f"{r['rowwise_dispatch_bytes'] / _GIB:.2f} ({r['rowwise_dispatch_ratio']:.3f}x)",
    ),
    ("dispatch FP8 mxfp8", lambda r: f"{r['mxfp8_dispatch_bytes'] / _GIB:.2f} ({r['mxfp8_dispatch_ratio']:.3f}x)"),
    ("all 4 bf16", lambda r: f"{r['bf16_step_bytes'] / _GIB:.2f}"),
    ("all 4, FP8 dispatch", lambda r: f"{r['rowwise_step_ratio']:.3f}x / {r['mxfp8_step_ratio']:.3f}x"),
)


def render_traffic(rows: list[dict]) -> str:
    """The rows of :func:`~titan_primus.diagnostics.traffic.fsdp.traffic_rows`."""
    return (
        f"FSDP2 all-gather traffic per step and rank on {rows[0]['ranks']} ranks (MODEL, computed from shapes; "
        f"see titan_primus/diagnostics/traffic/fsdp.py), GiB:\n"
        "rowwise applies to the Primus-Turbo v0.3.1+ definition only; other rowwise definitions gather in bf16; "
        "blockwise weights whose shards are not whole 128-row blocks gather in bf16\n"
        f"{column_table(_FSDP_COLUMNS, rows)}\n"
    )


def render_ep_traffic(rows: list[dict]) -> str:
    """The rows of :func:`~titan_primus.diagnostics.traffic.ep.ep_traffic_rows`."""
    return (
        f"Expert-parallel all-to-all traffic per step and rank, {rows[0]['model']}, {rows[0]['tokens_per_rank']} "
        f"tokens per rank, uniform routing (MODEL, computed from shapes; see titan_primus/diagnostics/traffic/ep.py), "
        "GiB sent:\n"
        "FP8 dispatch (fp8_dispatch) changes the forward dispatch only; combine and both gradients stay bf16\n"
        f"{column_table(_EP_COLUMNS, rows)}\n"
    )
