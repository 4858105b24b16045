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

Only the workarounds TorchTitan 0.3.0 needs on a machine without an
accelerator are applied (the device is forced to CPU even if one exists); each is explained where it is made. Apart from the
attention swap (FlexAttention -> causal SDPA) none changes the numerics.
"""

import os
import resource
import socket
import sys
import types

# (0) The debug configs' dataset/tokenizer are local files: never reach for the
#     Hugging Face Hub (the machine may be offline).
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# (1) The trainer reads LOCAL_RANK (tools/utils.get_local_device) and
#     init_process_group needs a rendezvous: torchrun sets these; a plain
#     `python examples/cpu_launch.py` gets a single-process world here.
if "LOCAL_RANK" not in os.environ:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        os.environ.setdefault(k, v)


def _total_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# (2) tools/utils.py picks `_get_available_device_type() or "cuda"`, so with no
#     accelerator the trainer calls torch.cuda.set_device and dies. Several
#     modules do `from torchtitan.tools.utils import device_type, device_module`
#     at import time, so both names must be patched before anything else from
#     torchtitan is imported. torch.cpu lacks the memory/introspection calls the
#     trainer makes (metrics.DeviceMemoryMonitor, set_pg_timeouts' barrier uses
#     current_device() as an int device id): this shim supplies them. The
#     "memory" numbers it reports are the process's peak RSS.
_cpu_module = types.SimpleNamespace(
    is_available=lambda: True,
    device_count=lambda: 1,
    current_device=lambda: 0,
    set_device=lambda device: None,
    synchronize=lambda device=None: None,
    empty_cache=lambda: None,
    reset_peak_memory_stats=lambda device=None: None,
    get_device_name=lambda device=None: "cpu",
    get_device_properties=lambda device=None: types.SimpleNamespace(
        name="cpu", total_memory=_total_ram()
    ),
    memory_stats=lambda device=None: {
        "active_bytes.all.peak": _peak_rss(),
        "reserved_bytes.all.peak": _peak_rss(),
        "num_alloc_retries": 0,
        "num_ooms": 0,
    },
)

import torchtitan.tools.utils as _tt_utils  # noqa: E402  (must follow the env setup)

_tt_utils.device_type, _tt_utils.device_module = "cpu", _cpu_module
# gloo: distributed/utils._get_distributed_backend maps device_type through
# torch.distributed.Backend.default_device_backend_map, so "cpu" -> "gloo"
# follows from the patch above; nothing more is needed.

# (4) FSDP2 reduce-scatters gradients with ReduceOp.PREMUL_SUM(1 / factor), which gloo lacks;
#     TorchTitan sets factor 1 (it scales gradients itself), so a plain SUM is the same math.
import torchtitan.distributed.fsdp as _tt_fsdp  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402

_disable_gradient_division = _tt_fsdp.disable_fsdp_gradient_division


def _disable_gradient_division_gloo(model) -> None:
    _disable_gradient_division(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


_tt_fsdp.disable_fsdp_gradient_division = _disable_gradient_division_gloo

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
    return config


ConfigManager.parse_args = _parse_args_cpu


if __name__ == "__main__":
    from torchtitan.train import main

    sys.exit(main())
