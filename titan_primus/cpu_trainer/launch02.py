"""Run TorchTitan 0.2.x's real trainer (``torchtitan.train``) on a CPU. Tested with 0.2.2.

Usage (from the repository root; arguments are exactly ``torchtitan.train``'s)::

    OMP_NUM_THREADS=1 python titan_primus/cpu_trainer/launch02.py \\
        --job.config_file examples/torchtitan02/llama3_debug_fp8.toml

``torchrun --standalone --nproc_per_node=1 titan_primus/cpu_trainer/launch02.py ...`` works too;
a plain ``python`` run gets a single-process world here. Use ``OMP_NUM_THREADS=1`` on a 2-core
machine.

Only the workarounds TorchTitan 0.2.2 needs on a machine without an accelerator are applied
(the device is forced to CPU even if one exists); each is explained where it is made. None
changes the numerics. Importing this module applies them, so tests that build 0.2.x models
in-process import it before anything from torchtitan.
"""

import functools
import sys

import torch
import torch._utils

from titan_primus.cpu_trainer import (
    world as cpu_world,
)  # (0) offline Hugging Face, (1) a single-process world without torchrun

# (2) tools/utils.py picks `_get_available_device_type() or "cuda"` when it is imported, and
#     importing any torchtitan module imports it (torchtitan/__init__ registers the quantization
#     converters, which import torchtitan.distributed), and several modules copy its
#     device_type/device_module at import. So the CPU is chosen by answering tools/utils's two
#     questions while torchtitan is first imported, then handing torch its functions back.
#     torch.cpu lacks the memory/introspection calls the trainer makes: cpu_world supplies them.
if "torchtitan" in sys.modules:
    raise RuntimeError(
        "import titan_primus.cpu_trainer.launch02 before anything from torchtitan: it picks its device when first imported"
    )
_available_device_type, _device_module = torch._utils._get_available_device_type, torch._utils._get_device_module
torch._utils._get_available_device_type = lambda: "cpu"
torch._utils._get_device_module = lambda kind: cpu_world.CPU_DEVICE_MODULE if kind == "cpu" else _device_module(kind)
try:
    import torchtitan.tools.utils as _tt_utils
finally:
    torch._utils._get_available_device_type, torch._utils._get_device_module = _available_device_type, _device_module
assert _tt_utils.device_type == "cpu"

# (3) The MoE router counts tokens per expert with torch.histc on int64 expert indices, which
#     has a CUDA kernel but no CPU one ('"histogram_cpu" not implemented for Long'). Counting the
#     same integers as floats gives the same counts.
_histc = torch.histc


@functools.wraps(_histc)
def _histc_with_integer_cpu_input(input, *args, **kwargs):
    if input.device.type == "cpu" and not input.is_floating_point():
        return _histc(input.float(), *args, **kwargs).to(input.dtype)
    return _histc(input, *args, **kwargs)


torch.histc = _histc_with_integer_cpu_input

# (4) Without expert parallelism, high-precision GroupedExperts pad each token group through
#     generate_permute_indices, which launches a Triton kernel unless told use_cpu=True (only
#     the MoE unit tests do). Its CPU reference implementation computes the same indices.
import torchtitan.models.moe.utils as _moe_utils  # noqa: E402

_moe_utils.generate_permute_indices = functools.partial(_moe_utils.generate_permute_indices, use_cpu=True)

# (5) Several ranks on gloo (FSDP2): gradients reduced with a plain SUM
#     (cpu_world.with_sum_reduction). llama4's parallelize (used by deepseek_v3) imports the function.
import torchtitan.models.llama3.infra.parallelize as _llama3_parallelize  # noqa: E402
import torchtitan.models.llama4.infra.parallelize as _llama4_parallelize  # noqa: E402

_llama3_parallelize.disable_fsdp_gradient_division = _llama4_parallelize.disable_fsdp_gradient_division = (
    cpu_world.with_sum_reduction(_llama3_parallelize.disable_fsdp_gradient_division)
)


if __name__ == "__main__":
    from torchtitan.train import Trainer, main

    cpu_world.exit_without_teardown(main(Trainer))
