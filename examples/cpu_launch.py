"""Run TorchTitan 0.3.0's real trainer (``torchtitan.train.main``) on a CPU.

Usage (from the repository root; arguments are exactly ``torchtitan.train``'s)::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=1 \\
        examples/cpu_launch.py --module llama3 --config llama3_debugmodel \\
        --hf_assets_path examples/assets/tokenizer \\
        --dataloader.dataset_path examples/assets/corpus \\
        --training.steps 5 --training.seq_len 256 --training.local_batch_size 2

Other stock debug configs: ``--module deepseek_v3 --config deepseek_v3_debugmodel``,
``--module qwen3 --config qwen3_moe_debug`` (316M params, ~7 s/step). Add
``--checkpoint.enable --checkpoint.interval 2 --dump_folder DIR`` for DCP
checkpoints (a rerun with the same dump folder resumes from the latest
``DIR/checkpoint/step-N``), ``--compile.enable`` for torch.compile (inductor,
needs a C compiler), ``--debug.seed 42`` for a reproducible init.
(The assets come from ``examples/make_assets.py``.)

``python examples/cpu_launch.py ...`` also works for one process: the launcher
then sets the torchrun environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) itself. Use ``OMP_NUM_THREADS=1`` on a 2-core machine.

Only the workarounds TorchTitan 0.3.0 needs on a machine without an accelerator
(and with gloo for several ranks) are applied; the device is forced to CPU even if
one exists. Each is explained where it is made. Apart from the attention swap
(FlexAttention -> causal SDPA) none changes the numerics.
"""

import cpu_world  # (0) offline Hugging Face, (1) a single-process world without torchrun

# (2) tools/utils.py picks `_get_available_device_type() or "cuda"`, so with no
#     accelerator the trainer calls torch.cuda.set_device and dies. Several
#     modules do `from torchtitan.tools.utils import device_type, device_module`
#     at import time, so both names must be patched before anything else from
#     torchtitan is imported. torch.cpu lacks the memory/introspection calls the
#     trainer makes: cpu_world.CPU_DEVICE_MODULE supplies them.

import torchtitan.tools.utils as _tt_utils  # noqa: E402  (must follow the env setup)

_tt_utils.device_type, _tt_utils.device_module = "cpu", cpu_world.CPU_DEVICE_MODULE
# gloo: distributed/utils._get_distributed_backend maps device_type through
# torch.distributed.Backend.default_device_backend_map, so "cpu" -> "gloo"
# follows from the patch above; nothing more is needed.

# (4) FSDP2 on gloo: gradients reduced with a plain SUM (cpu_world.with_sum_reduction).
import torchtitan.distributed.fsdp as _tt_fsdp  # noqa: E402

_tt_fsdp.disable_fsdp_gradient_division = cpu_world.with_sum_reduction(_tt_fsdp.disable_fsdp_gradient_division)

from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.config.override import derive  # noqa: E402
from torchtitan.models.common.attention import (  # noqa: E402
    FlexAttention,
    ScaledDotProductAttention,
)


# (3) FlexAttention has no CPU backward (torch 2.14), and every language-model
#     config in 0.3.0 uses it (get_attention_config("flex")). Swap each
#     FlexAttention node for ScaledDotProductAttention(is_causal=True) in the
#     parsed config tree; derive() keeps every shared field (sharding included).
#     The trainer then builds no BlockMask (post_dataloading_process only does
#     for Flex/Varlen). This is done on the tree rather than as an
#     --override.imports entry so that it never conflicts with a user's override
#     of an enclosing node (TorchTitan refuses nested overrides).
#     NUMERICS CHANGE: plain causal attention over the packed sequence, so
#     tokens can attend across document boundaries (document masking is lost).
def flex_to_causal_sdpa(cfg: FlexAttention.Config) -> ScaledDotProductAttention.Config:
    return derive(cfg, ScaledDotProductAttention.Config)


def use_causal_sdpa(model_config) -> None:
    for fqn, attention, parent, attr in list(model_config.traverse(FlexAttention.Config)):
        if isinstance(parent, list):
            parent[attr] = flex_to_causal_sdpa(attention)
        else:
            setattr(parent, attr, flex_to_causal_sdpa(attention))
        print(f"[cpu_launch] {fqn}: FlexAttention -> causal SDPA (no FlexAttention backward on CPU)")


_parse_args = ConfigManager.parse_args


def _parse_args_cpu(self, args=None):
    config = _parse_args(self, args)
    use_causal_sdpa(config.model_spec.model)
    # (5) Expert parallelism: the default spmd_types backend's all-to-all gives the ranks
    #     mismatched split sizes on gloo ("ProcessGroupGloo::alltoall: invalid tensor size"),
    #     with or without titan-primus; the DTensor backend's all-to-all works.
    if config.parallelism.expert_parallel_degree > 1 and config.parallelism.spmd_backend == "spmd_types":
        config.parallelism.spmd_backend = "partial_dtensor"
        print("[cpu_launch] expert parallelism on gloo: parallelism.spmd_backend = partial_dtensor")
    return config


ConfigManager.parse_args = _parse_args_cpu


if __name__ == "__main__":
    from torchtitan.train import main

    cpu_world.exit_without_teardown(main())
