"""Every patch titan-primus makes to TorchTitan 0.3's internals (and torch's, for the trainer's
sake), one function each, with its :class:`Seam` record in :data:`SEAMS`. Written against
TorchTitan 0.3.0; ``titan-primus doctor`` lists them with whether each target exists in the
installed TorchTitan. Importing this module imports no TorchTitan: each function imports its
target when it patches it. docs/torchtitan04.md says where 0.4 moved them."""

from __future__ import annotations

import functools
import logging
import sys

from titan_primus.sentinel import drive_trainer

from ..common.imports import installed_version
from ..common.seams import Seam, replace_once

__all__ = [
    "SEAMS",
    "build_document_masks_on_host",
    "edit_parsed_config",
    "follow_train_steps",
    "record_initial_weights",
    "record_metrics",
    "recognise_fp8_in_has_quantization",
    "reduce_gradients_with_sum",
    "skip_end_of_training_wait",
    "use_cpu_device",
]

VERIFIED = "torchtitan 0.3.0"
logger = logging.getLogger("titan_primus")

HAS_QUANTIZATION = Seam(
    "has_quantization",
    "torchtitan.components.quantization.utils:has_quantization",
    VERIFIED,
    "the trainer logs no MFU against the bf16 peak for a model the converter made FP8",
)
TRAIN_STEP = Seam(
    "sentinel_train_step",
    "torchtitan.trainer:Trainer.train_step",
    VERIFIED,
    "the sentinel follows the trainer's step numbers and logs through its metric loggers",
)
CPU_DEVICE = Seam(
    "cpu_device",
    "torchtitan.tools.utils:device_type",
    VERIFIED,
    "CPU launcher: the trainer runs on the CPU (TorchTitan falls back to cuda without an accelerator)",
)
GLOO_SUM_REDUCTION = Seam(
    "gloo_sum_reduction",
    "torchtitan.distributed.fsdp:disable_fsdp_gradient_division",
    VERIFIED,
    "CPU launcher: FSDP2 reduces gradients with SUM on gloo, which lacks PREMUL_SUM (the same math)",
)
PARSED_CONFIG = Seam(
    "cpu_config",
    "torchtitan.config:ConfigManager.parse_args",
    VERIFIED,
    "CPU launcher: FlexAttention (no CPU backward) becomes SDPA, the local corpus, EP's all-to-all on gloo",
)
METRIC_LOGGER = Seam(
    "validate_metrics",
    "torchtitan.components.metrics:MetricsProcessor._build_metric_logger",
    VERIFIED,
    "validate: each step's loss, grad norm, throughput and memory recorded from the trainer's own metrics",
)
INIT_WEIGHTS = Seam(
    "validate_last_bit",
    "torchtitan.protocols.model:BaseModel.init_weights",
    VERIFIED,
    "validate: the initial weights' last bit flipped after the trainer initialised them",
)
END_OF_TRAINING_WAIT = Seam(
    "end_of_training_wait",
    "torchtitan.trainer:time",
    VERIFIED,
    "CPU launcher: rank 0's 2 s wait after the last step, for ranks that end by themselves, is skipped",
)
HOST_DOCUMENT_BATCHES = Seam(
    "host_document_masks",
    "torchtitan.trainer:Trainer.batch_generator",
    VERIFIED,
    "attention route: a document-masked batch's varlen masks built from its positions on the host, before the "
    "batch moves to the device (TorchTitan builds them on the device: one host sync per sequence, and one more)",
)
HOST_DOCUMENT_LOOKUP = Seam(
    "host_document_masks_used",
    "torchtitan.models.common.decoder:create_varlen_metadata_for_document",
    VERIFIED,
    "attention route: the decoder's varlen masks for positions whose masks were built on the host are those",
)
SEAMS = (
    HAS_QUANTIZATION,
    HOST_DOCUMENT_BATCHES,
    HOST_DOCUMENT_LOOKUP,
    TRAIN_STEP,
    CPU_DEVICE,
    GLOO_SUM_REDUCTION,
    END_OF_TRAINING_WAIT,
    PARSED_CONFIG,
    METRIC_LOGGER,
    INIT_WEIGHTS,
)


def recognise_fp8_in_has_quantization(is_converted) -> None:
    """Make TorchTitan's ``has_quantization(model_config)`` also true where ``is_converted``.

    The trainer asks it whether the model is quantized and then logs no MFU (MFU against the
    bf16 peak misleads for FP8). In TorchTitan 0.3.0 it recognises only TorchTitan's own
    float8/MXFP8/NVFP4 Config classes and offers no registration hook, so it is wrapped. Both
    places that hold the function are updated (its module, and ``torchtitan.trainer``, which
    imported it by name). Done when a converter is built, which is before the trainer asks.
    """
    missing = HAS_QUANTIZATION.missing()
    if missing:
        # Only the MFU line depends on it: training goes on, and the user learns why MFU shows.
        _warn_has_quantization_moved(missing)
        return
    module, name = HAS_QUANTIZATION.owner_and_attribute()
    original = getattr(module, name)

    def wrap(original):
        @functools.wraps(original)
        def has_quantization(model_config) -> bool:
            return original(model_config) or is_converted(model_config)

        return has_quantization

    installed = replace_once(HAS_QUANTIZATION, wrap)
    trainer = sys.modules.get("torchtitan.trainer")
    if trainer is not None and getattr(trainer, "has_quantization", None) is original:
        trainer.has_quantization = installed


@functools.cache
def _warn_has_quantization_moved(missing: str) -> None:
    logger.warning(
        "titan-primus: TorchTitan %s has no %s (%s), which titan-primus wraps so that the trainer knows an FP8 "
        "model is quantized (verified on %s): TorchTitan moved or renamed it, so the trainer logs MFU against the "
        "bf16 peak. Training is unaffected. Fix: install torchtitan==0.3.0, or a titan-primus that supports this "
        "TorchTitan",
        installed_version("torchtitan"),
        HAS_QUANTIZATION.target.replace(":", "."),
        missing,
        VERIFIED,
    )


def build_document_masks_on_host(host_masks, takes_documents) -> None:
    """The trainer's batches of a model where ``takes_documents(model_config)`` go through
    ``host_masks.add`` (v0_3.attention.HostDocumentMasks) as the dataloader yields them, and the
    decoder's ``create_varlen_metadata_for_document`` returns ``host_masks.take(positions)`` where
    that has them: TorchTitan's ``train_step`` moves a batch to the device before
    ``post_dataloading_process`` builds its masks, so the host's copy of the positions is seen
    only in ``batch_generator``. Idempotent."""

    def wrap_batches(batch_generator):
        @functools.wraps(batch_generator)
        def batch_generator_with_host_masks(self, data_iterable):
            batches = batch_generator(self, data_iterable)
            if not takes_documents(self.model_config):
                yield from batches
                return
            for input_dict, labels in batches:
                host_masks.add(input_dict, self.device)
                yield input_dict, labels

        return batch_generator_with_host_masks

    def wrap_lookup(create):
        @functools.wraps(create)
        def create_or_host_built(positions, **kwargs):
            built = None if kwargs else host_masks.take(positions)
            return create(positions, **kwargs) if built is None else built

        return create_or_host_built

    replace_once(HOST_DOCUMENT_BATCHES, wrap_batches)
    replace_once(HOST_DOCUMENT_LOOKUP, wrap_lookup)


def follow_train_steps(compile_enabled) -> None:
    """The sentinel's step hook on TorchTitan's ``Trainer.train_step`` (idempotent)."""
    trainer_cls, _ = TRAIN_STEP.owner_and_attribute()
    drive_trainer(trainer_cls, compile_enabled)


def use_cpu_device(device_module) -> None:
    """tools/utils.py picks ``_get_available_device_type() or "cuda"``, so with no accelerator the
    trainer calls torch.cuda.set_device and dies. Several modules do ``from torchtitan.tools.utils
    import device_type, device_module`` at import time, so both names are set before anything else
    from torchtitan is imported. gloo follows: distributed/utils maps "cpu" to it."""
    utils, _ = CPU_DEVICE.owner_and_attribute()
    utils.device_type, utils.device_module = "cpu", device_module


def reduce_gradients_with_sum(with_sum_reduction) -> None:
    """FSDP2 on gloo: TorchTitan's ``disable_fsdp_gradient_division`` wrapped by
    ``with_sum_reduction`` (common.cpu_world)."""
    replace_once(GLOO_SUM_REDUCTION, with_sum_reduction)


def skip_end_of_training_wait(without_sleep) -> None:
    """The trainer module's ``time`` replaced by ``without_sleep(time)`` (common.cpu_world), whose
    ``sleep`` does nothing: the trainer's only sleep is rank 0's wait after the last step."""
    replace_once(END_OF_TRAINING_WAIT, without_sleep)


def edit_parsed_config(edit) -> None:
    """``ConfigManager.parse_args`` becomes ``edit(parse, args)``: ``parse(args)`` is TorchTitan's
    own, ``args`` the command line it was given; ``edit`` returns the config the trainer gets."""

    def wrap(parse_args):
        def parse_args_edited(self, args=None):
            return edit(functools.partial(parse_args, self), list(sys.argv[1:] if args is None else args))

        return parse_args_edited

    replace_once(PARSED_CONFIG, wrap)


def record_metrics(wrap_logger) -> None:
    """Each metric logger the trainer builds, wrapped: ``wrap_logger(logger, on_metrics_rank)``,
    where the rank is the one TorchTitan itself logs metrics from (``_get_metrics_rank``)."""
    import torch.distributed as dist
    from torchtitan.components.metrics import _get_metrics_rank

    def wrap(build_metric_logger):
        def build_recording_logger(self, *args, **kwargs):
            rank = _get_metrics_rank(parallel_dims=kwargs["parallel_dims"], pp_schedule=kwargs["pp_schedule"])
            return wrap_logger(build_metric_logger(self, *args, **kwargs), dist.get_rank() == rank)

        return build_recording_logger

    replace_once(METRIC_LOGGER, wrap)


def record_initial_weights(after_init) -> None:
    """``after_init(model)`` once each model part's ``init_weights`` has run."""

    def wrap(init_weights):
        def init_weights_then(self, *args, **kwargs):
            init_weights(self, *args, **kwargs)
            after_init(self)

        return init_weights_then

    replace_once(INIT_WEIGHTS, wrap)
