"""TorchTitan 0.2.x's expert parallelism with FP8 token dispatch: the dispatch all-to-all sends
the routed tokens as FP8 payload plus scales (titan_primus.token_dispatch); the token counts,
TorchTitan's permute, combine and every gradient are TorchTitan's own.

TorchTitan 0.2.x moves the tokens in ``ExpertParallel._token_dispatch``
(torchtitan/distributed/expert_parallel.py), a ParallelStyle input hook that
``apply_moe_ep_tp`` (torchtitan/models/llama4/infra/parallelize.py; deepseek_v3 and qwen3 call
it too) builds as ``ExpertParallel()`` for every MoE layer. :func:`install_fp8_expert_parallel`
points that name at :class:`Fp8ExpertParallel`, which is ``ExpertParallel`` for every module but
an ``Fp8GroupedExperts`` whose recipe dispatches in FP8.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torchtitan.distributed.expert_parallel import ExpertParallel
from torchtitan.models.moe.utils import _permute
from torchtitan.protocols.train_spec import get_train_spec

from titan_primus.token_dispatch import fp8_all_to_all

from .seams import build_expert_parallel_as

__all__ = ["Fp8ExpertParallel", "install_fp8_expert_parallel"]

# What ExpertParallel._token_combine reads from the dispatch (0.2.0-0.2.2).
_DISPATCH_STATE = ("input_splits", "output_splits", "input_shape", "permuted_indices")


class Fp8ExpertParallel(ExpertParallel):
    """``ExpertParallel`` whose dispatch all-to-all runs in FP8 for experts that carry a
    ``fp8_dispatch_cast`` (an ``Fp8GroupedExperts`` with FP8 token dispatch); for every other
    module, TorchTitan's own."""

    def _apply(self, module, device_mesh):
        _mark(module)
        return super()._apply(module, device_mesh)

    def _partition_fn(self, name, mod, device_mesh):
        _mark(mod)  # DualPipeExpertParallel (0.2.1+) wraps this style and calls this, not _apply
        return super()._partition_fn(name, mod, device_mesh)

    def _token_dispatch(self, mod, inputs, device_mesh):
        cast = getattr(mod, "fp8_dispatch_cast", None)
        if cast is None:
            return super()._token_dispatch(mod, inputs, device_mesh)
        routed_input, num_tokens_per_expert = inputs
        ep_degree, group = device_mesh.shape[0], device_mesh.get_group()
        # The token counts and splits exactly as ExpertParallel._token_dispatch computes them
        # (torchtitan/distributed/expert_parallel.py, 0.2.0-0.2.2), re-stated because that method
        # runs the tokens' all-to-all between them and the permute.
        with torch.no_grad():
            counts = funcol.wait_tensor(funcol.all_to_all_single(num_tokens_per_expert, None, None, group))
            input_splits = num_tokens_per_expert.view(ep_degree, -1).sum(dim=1).to("cpu", non_blocking=True)
            output_splits = counts.view(ep_degree, -1).sum(dim=1).to("cpu")  # the host sync, as upstream
            self.input_splits, self.output_splits = input_splits.tolist(), output_splits.tolist()
        routed_input = fp8_all_to_all(routed_input, cast, self.output_splits, self.input_splits, group)
        # TorchTitan's own permute (and padding) of the received tokens; its _token_combine undoes it.
        num_local_experts = num_tokens_per_expert.shape[0] // ep_degree
        self.input_shape, routed_input, self.permuted_indices, counts = _permute(
            routed_input, counts, ep_degree, num_local_experts
        )
        return routed_input, counts


def _mark(module) -> None:
    if getattr(module, "fp8_dispatch_cast", None) is not None:
        module.fp8_dispatch_installed = True


def install_fp8_expert_parallel(model_name: str) -> str | None:
    """Make the ``ExpertParallel()`` that ``model_name``'s parallelize function builds (through
    ``apply_moe_ep_tp``) an :class:`Fp8ExpertParallel`. None when done (or already), else the
    reason it cannot be.

    Process-wide, and never undone: it rebinds ``ExpertParallel`` in the globals of the module
    that defines ``apply_moe_ep_tp`` (llama4's parallelize, which deepseek_v3 and qwen3 import),
    for every model and trainer in the process. It cannot be scoped to one model: the converter
    runs in the trainer's ``__init__`` before the trainer calls the parallelize function, which
    builds its ``ExpertParallel()`` inside, and 0.2.x has no hook between the two to restore the
    name after. Idempotent, and inert for everything else: for a module without an FP8 dispatch
    cast the subclass is ``ExpertParallel`` itself (bitwise: tests/integrations/torchtitan/v0_2/fp8_dispatch_exchange.py)."""
    parallelize = get_train_spec(model_name).parallelize_fn
    apply_moe_ep_tp = getattr(parallelize, "__globals__", {}).get("apply_moe_ep_tp")
    namespace = getattr(apply_moe_ep_tp, "__globals__", {})
    where = f"{getattr(parallelize, '__module__', '?')}.{getattr(parallelize, '__name__', '?')}"
    if namespace.get("ExpertParallel") not in (ExpertParallel, Fp8ExpertParallel):
        return (
            f"{model_name}'s parallelize function ({where}) does not build TorchTitan's ExpertParallel "
            f"through apply_moe_ep_tp, the all-to-all FP8 dispatch replaces"
        )
    state = vars(ExpertParallel())
    missing = [name for name in _DISPATCH_STATE if name not in state]
    if missing:
        return f"this TorchTitan's ExpertParallel keeps no {', '.join(missing)}: not the 0.2.0-0.2.2 dispatch"
    build_expert_parallel_as(apply_moe_ep_tp, Fp8ExpertParallel)
    return None
