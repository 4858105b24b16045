"""TorchTitan 0.2.x modules that run their GEMMs through a titan-primus backend.

Each replaces a module of the meta model and takes over its parameters (same names, shapes and
dtypes), so state dicts, checkpoints and TorchTitan's FQN-keyed parallelism plans are unchanged.
The backend and recipe are fixed at conversion, so the forward pass does no routing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torchtitan.models.moe.moe import GroupedExperts
from torchtitan.models.moe.utils import indices_padding_wrapper

from titan_primus.fsdp_fp8 import Fp8AllGatherPlan, enable_fp8_all_gather
from titan_primus.ops import run_grouped_mm, run_linear
from titan_primus.recipes import Fp8Recipe
from titan_primus.routing import RoutingDecision
from titan_primus.token_dispatch import DispatchCast, fp8_copy, fp8_dispatch_cast

__all__ = ["Fp8Linear", "Fp8GroupedExperts"]


class Fp8Linear(nn.Linear):
    """``nn.Linear`` whose GEMMs run in FP8 on a titan-primus backend."""

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, decision: RoutingDecision, all_gather: Fp8AllGatherPlan | None = None
    ) -> "Fp8Linear":
        """``all_gather``: FSDP2 gathers the weight as FP8 per this plan (None: bf16)."""
        with torch.device("meta"):  # placeholders only: the original's parameters move over
            fp8 = cls(linear.in_features, linear.out_features, bias=False)
        fp8.weight, fp8.bias = linear.weight, linear.bias
        fp8.fp8_backend, fp8.fp8_recipe = decision.backend, decision.recipe
        if all_gather is not None:
            enable_fp8_all_gather(fp8, "weight", all_gather)
        return fp8.train(linear.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_linear(self.fp8_backend, x, self.weight, self.bias, self.fp8_recipe)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8_backend.name}:{self.fp8_recipe.describe()}"


def _expert_parallel(weight: torch.Tensor) -> bool:
    return isinstance(weight, DTensor) and "ep" in weight.device_mesh.mesh_dim_names


class Fp8GroupedExperts(GroupedExperts):
    """MoE experts (params ``w1/w2/w3``) whose three grouped GEMMs run in FP8 on a backend.

    TorchTitan 0.2.x has no grouped-GEMM seam to override (0.3's ``_grouped_mm``): its forward
    calls the module-level ``_run_experts_grouped_mm``, so this forward is that function with
    each ``torch._grouped_mm`` replaced by the backend's, on the same operands. Two differences:
    token groups are padded only for a backend that needs aligned groups (TorchTitan pads them
    for ``torch._grouped_mm``; padding rows are zeros and change no result), and the experts
    always run grouped (``use_grouped_mm=False`` only picks TorchTitan's high-precision loop).

    With FP8 token dispatch (``fp8_dispatch_cast``) the experts take the FP8 copy of their input:
    under expert parallelism ``Fp8ExpertParallel``'s all-to-all delivers it, without it the
    forward takes it (``fp8_copy``), so both compute the same.
    """

    fp8_dispatch_cast: DispatchCast | None = None
    """``fp8_dispatch_cast(fp8_recipe)``: what the routed tokens arrive in (None: in the activations' dtype)."""
    fp8_dispatch_installed: bool = False
    """Set by ``Fp8ExpertParallel`` when it parallelises this module."""

    @classmethod
    def from_experts(
        cls,
        experts: GroupedExperts,
        decision: RoutingDecision,
        group_alignment: int | None,
        all_gather: Fp8AllGatherPlan | None = None,
        *,
        recipe: Fp8Recipe | None = None,
    ):
        """``all_gather``: FSDP2 gathers w1/w2/w3 as FP8 per this plan (None: bf16);
        ``recipe``: instead of the decision's (with FP8 token dispatch)."""
        num_experts, hidden_dim, dim = experts.w1.shape
        with torch.device("meta"):
            fp8 = cls(dim, hidden_dim, num_experts, experts.use_grouped_mm)
        fp8.w1, fp8.w2, fp8.w3 = experts.w1, experts.w2, experts.w3
        fp8.fp8_backend, fp8.fp8_recipe = decision.backend, recipe or decision.recipe
        fp8.fp8_dispatch_cast = fp8_dispatch_cast(fp8.fp8_recipe)
        fp8.pad_token_groups = group_alignment is not None
        if all_gather is not None:
            for name in ("w1", "w2", "w3"):
                enable_fp8_all_gather(fp8, name, all_gather)
        return fp8.train(experts.training)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        # DTensor parameters become local tensors, as in GroupedExperts: EP inputs are dynamic-shape.
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        run, expert_parallel = self._run_grouped, _expert_parallel(self.w1)
        if self.fp8_dispatch_cast is not None:
            if not expert_parallel:  # no all-to-all: the same FP8 copy it would deliver
                x = fp8_copy(x, self.fp8_dispatch_cast)
            elif not self.fp8_dispatch_installed:
                raise RuntimeError(
                    "titan-primus: these experts run under expert parallelism with FP8 token dispatch, but "
                    "TorchTitan's ExpertParallel, not titan-primus's Fp8ExpertParallel, parallelised them, so "
                    "the tokens crossed the all-to-all in the activations' dtype. Parallelise the model with "
                    "its train spec's parallelize function, or set [titan_primus] fp8_dispatch = false."
                )
        # Pad token groups only for a backend that needs aligned groups (the converter has set
        # TorchTitan's alignment to its multiple). Under EP the token dispatch already pads them.
        if self.pad_token_groups and not expert_parallel:
            run = indices_padding_wrapper(run)
        return run(w1, w2, w3, x, num_tokens_per_expert)

    def _run_grouped(self, w1, w2, w3, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        backend, recipe = self.fp8_backend, self.fp8_recipe
        # x is cast once per GEMM, as TorchTitan does: x's gradient then sums the two branches
        # in x's dtype, not in bf16.
        h = F.silu(run_grouped_mm(backend, x.bfloat16(), w1.bfloat16().transpose(-2, -1), offs, recipe))
        h = h * run_grouped_mm(backend, x.bfloat16(), w3.bfloat16().transpose(-2, -1), offs, recipe)
        return run_grouped_mm(backend, h, w2.bfloat16().transpose(-2, -1), offs, recipe).type_as(x)

    def extra_repr(self) -> str:
        return f"fp8={self.fp8_backend.name}:{self.fp8_recipe.describe()}"
