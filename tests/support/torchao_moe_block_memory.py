"""Bytes one MoE block's experts keep from forward to backward on TorchAO's grouped GEMM, as
TorchTitan's GroupedExperts calls it (w1 and w3 on the same routed tokens, w2 on their product),
TorchAO's own Python on CPU stand-ins for its kernels (tests/support/doubles/torchao_grouped_kernels.py).

    PYTHONPATH=$PWD .venv/bin/python tests/support/torchao_moe_block_memory.py [tokens dim hidden experts]
"""

from __future__ import annotations

import sys

import pytest
import torch
from support.doubles import torchao_grouped_kernels

import titan_primus as tp
from titan_primus.diagnostics.memory.saved import kept_for_backward, recording_saved_tensors


def moe_block_kept(tokens: int = 512, dim: int = 256, hidden: int = 384, experts: int = 4) -> dict:
    """Bytes kept per category, and how many saved storages hold the routed tokens."""
    decision = tp.select_backend("grouped_mm", "rowwise", "sm90", "torchao")
    g = torch.Generator().manual_seed(0)
    per_expert = (tokens - 16) // experts // 16 * 16  # 16-aligned groups, the rest trails
    offs = torch.arange(1, experts + 1, dtype=torch.int32) * per_expert
    x = torch.randn(tokens, dim, generator=g).bfloat16().requires_grad_()
    w1, w3 = (torch.nn.Parameter((torch.randn(experts, hidden, dim, generator=g) * 0.05).bfloat16()) for _ in "13")
    w2 = torch.nn.Parameter((torch.randn(experts, dim, hidden, generator=g) * 0.05).bfloat16())

    def mm(a, w):
        return decision.backend.grouped_mm(a, w.transpose(-2, -1), offs, decision.recipe)

    with pytest.MonkeyPatch.context() as monkeypatch:
        torchao_grouped_kernels.install(monkeypatch)
        with recording_saved_tensors() as saved:
            out = mm(torch.nn.functional.silu(mm(x, w1)) * mm(x, w3), w2)
        shapes = [w.shape for w in (w1, w3, w2)]
        kept = kept_for_backward(saved, shapes, [w1, w2, w3], rows=tokens, widths=(dim, hidden))
        token_copies = len({t.untyped_storage().data_ptr() for t in saved if tuple(t.shape) == (tokens, dim)})
        out.float().sum().backward()
    return {"kept": kept, "token_copies": token_copies, "total": sum(kept.values()) - kept["parameter"]}


if __name__ == "__main__":
    result = moe_block_kept(*map(int, sys.argv[1:]))
    print(
        f"kept per MoE block (TorchAO rowwise grouped GEMM): {result['total']} B besides the parameters "
        f"({result['kept']}); saved storages of the routed tokens: {result['token_copies']}"
    )
