"""Every patch titan-primus makes to TorchTitan 0.2.x's internals (and torch's, for the trainer's
sake), one function each, with its :class:`Seam` record in :data:`SEAMS`. Written against
TorchTitan 0.2.2 (the API 0.2.0-0.2.2 share); ``titan-primus doctor`` lists them with whether each
target exists in the installed TorchTitan. Importing this module imports no TorchTitan: each
function imports its target when it patches it."""

from __future__ import annotations

import functools
import logging
import sys

import torch

from titan_primus.sentinel import drive_trainer

from ..common.seams import Seam, replace_once

__all__ = [
    "SEAMS",
    "build_expert_parallel_as",
    "count_integer_histograms_on_cpu",
    "edit_parsed_config",
    "follow_train_steps",
    "permute_indices_on_cpu",
    "record_metrics",
    "reduce_gradients_with_sum",
    "skip_end_of_training_wait",
    "save_in_selective_ac",
    "use_cpu_device",
]

VERIFIED = "torchtitan 0.2.2"
logger = logging.getLogger("titan_primus")

TRAIN_STEP = Seam(
    "sentinel_train_step",
    "torchtitan.train:Trainer.train_step",
    VERIFIED,
    "the sentinel follows the trainer's step numbers and logs through its metric loggers",
)
SAC_SAVE_LIST = Seam(
    "selective_ac_save_list",
    "torchtitan.models.llama3.infra.parallelize:_op_sac_save_list",
    VERIFIED,
    "per-op selective AC saves the FP8 GEMMs' outputs (each model's parallelize module has its own list)",
)
CPU_DEVICE = Seam(
    "cpu_device",
    "torchtitan.tools.utils:device_type",
    VERIFIED,
    "CPU launcher: the trainer runs on the CPU (picked while torchtitan is first imported)",
)
CPU_HISTC = Seam(
    "cpu_integer_histc",
    "torch:histc",
    f"torch 2.12-2.14 ({VERIFIED})",
    "CPU launcher: the MoE router counts int64 expert indices, which torch.histc has no CPU kernel for",
)
CPU_PERMUTE_INDICES = Seam(
    "cpu_permute_indices",
    "torchtitan.models.moe.utils:generate_permute_indices",
    VERIFIED,
    "CPU launcher: token groups padded by the CPU reference instead of a Triton kernel",
)
GLOO_SUM_REDUCTION = Seam(
    "gloo_sum_reduction",
    "torchtitan.models.llama3.infra.parallelize:disable_fsdp_gradient_division",
    VERIFIED,
    "CPU launcher: FSDP2 reduces gradients with SUM on gloo, which lacks PREMUL_SUM (the same math)",
)
EXPERT_PARALLEL = Seam(
    "fp8_expert_parallel",
    "torchtitan.models.llama4.infra.parallelize:ExpertParallel",
    VERIFIED,
    "FP8 token dispatch: the ExpertParallel that apply_moe_ep_tp builds is titan-primus's subclass",
)
PARSED_CONFIG = Seam(
    "validate_converters",
    "torchtitan.config:ConfigManager.parse_args",
    VERIFIED,
    "validate: the converter added to (FP8 runs) or removed from (bf16 runs) model.converters",
)
METRIC_LOGGER = Seam(
    "validate_metrics",
    "torchtitan.components.metrics:_build_metric_logger",
    VERIFIED,
    "validate: each step's loss, grad norm, throughput and memory recorded from the trainer's own metrics",
)
END_OF_TRAINING_WAIT = Seam(
    "end_of_training_wait",
    "torchtitan.train:time",
    VERIFIED,
    "CPU launcher: rank 0's 2 s wait after the last step, for ranks that end by themselves, is skipped",
)
SEAMS = (
    TRAIN_STEP,
    SAC_SAVE_LIST,
    EXPERT_PARALLEL,
    CPU_DEVICE,
    CPU_HISTC,
    CPU_PERMUTE_INDICES,
    GLOO_SUM_REDUCTION,
    END_OF_TRAINING_WAIT,
    PARSED_CONFIG,
    METRIC_LOGGER,
)


def follow_train_steps(compile_enabled) -> None:
    """The sentinel's step hook on TorchTitan's ``Trainer.train_step`` (idempotent)."""
    trainer_cls, _ = TRAIN_STEP.owner_and_attribute()
    drive_trainer(trainer_cls, compile_enabled)


def save_in_selective_ac(parallelize_fn, ops: set, model_name: str) -> None:
    """Add ``ops`` to the save list of 0.2.x's per-op selective activation checkpointing: the
    module-level ``_op_sac_save_list`` of the module defining ``parallelize_fn``, which that
    function hands to ``apply_ac`` (read when each op runs, so adding to it before then is enough)."""
    module = sys.modules.get(getattr(parallelize_fn, "__module__", ""))
    save_list = getattr(module, "_op_sac_save_list", None)
    if not isinstance(save_list, set):
        logger.warning(
            "titan-primus: %s's parallelize function has no _op_sac_save_list (%s): with selective per-op "
            "activation checkpointing its FP8 GEMMs run again in backward",
            model_name,
            SAC_SAVE_LIST.target,
        )
        return
    save_list.update(ops)


def build_expert_parallel_as(apply_moe_ep_tp, expert_parallel_cls) -> None:
    """Rebind ``ExpertParallel`` in the globals of the module defining ``apply_moe_ep_tp`` (llama4's
    parallelize for deepseek_v3 and qwen3; ``EXPERT_PARALLEL`` names it), process-wide: 0.2.x
    builds its ``ExpertParallel()`` inside the parallelize function, with no hook to pass one."""
    apply_moe_ep_tp.__globals__["ExpertParallel"] = expert_parallel_cls


def use_cpu_device(device_module) -> None:
    """tools/utils.py picks ``_get_available_device_type() or "cuda"`` when it is imported, and
    importing any torchtitan module imports it (torchtitan/__init__ registers the quantization
    converters, which import torchtitan.distributed), and several modules copy its
    device_type/device_module at import. So the CPU is chosen by answering tools/utils's two
    questions while torchtitan is first imported, then handing torch its functions back."""
    if "torchtitan" in sys.modules:
        raise RuntimeError(
            "import titan_primus.integrations.torchtitan.v0_2.launch before anything from torchtitan: it picks its "
            "device when first imported"
        )
    available, get_module = torch._utils._get_available_device_type, torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda kind: device_module if kind == "cpu" else get_module(kind)
    try:
        utils, _ = CPU_DEVICE.owner_and_attribute()
    finally:
        torch._utils._get_available_device_type, torch._utils._get_device_module = available, get_module
    assert utils.device_type == "cpu"


def count_integer_histograms_on_cpu() -> None:
    """torch.histc has a CUDA kernel for int64 input but no CPU one ('"histogram_cpu" not
    implemented for Long'); counting the same integers as floats gives the same counts."""

    def wrap(histc):
        @functools.wraps(histc)
        def histc_with_integer_cpu_input(input, *args, **kwargs):
            if input.device.type == "cpu" and not input.is_floating_point():
                return histc(input.float(), *args, **kwargs).to(input.dtype)
            return histc(input, *args, **kwargs)

        return histc_with_integer_cpu_input

    replace_once(CPU_HISTC, wrap)


def permute_indices_on_cpu() -> None:
    """Without expert parallelism, high-precision GroupedExperts pad each token group through
    generate_permute_indices, which launches a Triton kernel unless told use_cpu=True (only the
    MoE unit tests do). Its CPU reference implementation computes the same indices."""
    replace_once(CPU_PERMUTE_INDICES, lambda generate: functools.partial(generate, use_cpu=True))


def reduce_gradients_with_sum(with_sum_reduction) -> None:
    """FSDP2 on gloo: ``disable_fsdp_gradient_division`` wrapped by ``with_sum_reduction``
    (common.cpu_world), in llama3's parallelize and in llama4's (deepseek_v3's), which imports it."""
    import torchtitan.models.llama4.infra.parallelize as llama4_parallelize

    wrapped = replace_once(GLOO_SUM_REDUCTION, with_sum_reduction)
    llama4_parallelize.disable_fsdp_gradient_division = wrapped


def skip_end_of_training_wait(without_sleep) -> None:
    """The trainer module's ``time`` replaced by ``without_sleep(time)`` (common.cpu_world), whose
    ``sleep`` does nothing: the trainer's only sleep is rank 0's wait after the last step."""
    replace_once(END_OF_TRAINING_WAIT, without_sleep)


def edit_parsed_config(edit) -> None:
    """``ConfigManager.parse_args`` hands its parsed config to ``edit``, which returns the config
    the trainer gets."""

    def wrap(parse_args):
        def parse_args_edited(self, *args, **kwargs):
            return edit(parse_args(self, *args, **kwargs))

        return parse_args_edited

    replace_once(PARSED_CONFIG, wrap)


def record_metrics(wrap_logger) -> None:
    """Each metric logger the trainer builds, wrapped: ``wrap_logger(logger, on_metrics_rank)``,
    where the rank is the one TorchTitan itself logs metrics from (``_get_metrics_rank``).
    ``MetricsProcessor.__init__`` calls the module's ``_build_metric_logger`` by name."""
    import torch.distributed as dist
    import torchtitan.components.metrics as tt_metrics

    def wrap(build_metric_logger):
        def build_recording_logger(job_config, parallel_dims, *args, **kwargs):
            records = dist.get_rank() == tt_metrics._get_metrics_rank(parallel_dims, job_config)
            return wrap_logger(build_metric_logger(job_config, parallel_dims, *args, **kwargs), records)

        return build_recording_logger

    replace_once(METRIC_LOGGER, wrap)
