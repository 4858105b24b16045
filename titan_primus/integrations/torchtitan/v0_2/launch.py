"""Run TorchTitan 0.2.x's real trainer (``torchtitan.train``) on a CPU. Tested with 0.2.2.

Usage (from the repository root; arguments are exactly ``torchtitan.train``'s)::

    OMP_NUM_THREADS=1 python titan_primus/integrations/torchtitan/v0_2/launch.py \\
        --job.config_file examples/torchtitan02/llama3_debug_fp8.toml

``torchrun --standalone --nproc_per_node=1 titan_primus/integrations/torchtitan/v0_2/launch.py ...`` works too;
a plain ``python`` run gets a single-process world here. Use ``OMP_NUM_THREADS=1`` on a 2-core
machine.

Only the workarounds TorchTitan 0.2.2 needs on a machine without an accelerator are applied
(the device is forced to CPU even if one exists); each is explained where it is made. None
changes the numerics. Importing this module applies them, so tests that build 0.2.x models
in-process import it before anything from torchtitan.
"""

from titan_primus.integrations.torchtitan.common import (
    cpu_world,
)  # (0) offline Hugging Face, (1) a single-process world without torchrun

# (2) the CPU device, picked while torchtitan is first imported; (3) the MoE router's torch.histc
#     on int64 indices; (4) the CPU permute indices of token groups; (5) FSDP2's gradient
#     reduction on gloo; (6) no wait after the last step: patches of TorchTitan and torch, in seams.py.
from titan_primus.integrations.torchtitan.v0_2 import seams  # noqa: E402

seams.use_cpu_device(cpu_world.CPU_DEVICE_MODULE)
seams.count_integer_histograms_on_cpu()
seams.permute_indices_on_cpu()
seams.reduce_gradients_with_sum(cpu_world.with_sum_reduction)
seams.skip_end_of_training_wait(cpu_world.without_sleep)


if __name__ == "__main__":
    from torchtitan.train import Trainer, main

    cpu_world.exit_without_teardown(main(Trainer))
