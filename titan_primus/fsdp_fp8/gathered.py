"""The unsharded side: the gathered FP8 weight the FP8 GEMM receives."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map_only

from ..fp8.blocks import dequantize_matrices
from ..fp8.scaling import dequantize

__all__ = ["Fp8GatheredWeight"]


class Fp8GatheredWeight(torch.Tensor):
    """A gathered FP8 weight as the emulated and Primus-Turbo backends consume it: ``_data``
    (FP8; [N, K], or [E, N, K] for expert weights) and ``_scale`` (float32, [] or broadcastable
    to ``_data``: [N, 1], [E, N, 1]; for square ``block`` x ``block`` scaling blocks, each
    block's scale_inv, what block-scaled GEMMs multiply by: [ceil(N / block), ceil(K / block)],
    [E, ...]); it presents itself as the weight in ``dtype``. Autograd treats it as the unsharded
    parameter; its gradient is a plain tensor.

    The views and casts a layer makes of its weight before the GEMM keep it FP8: transposes
    (an expert's ``B_t``), zero padding (the emulation's alignment), and the cast to
    ``source_dtype``, the dtype the payload was quantized from. Anything else sees the
    dequantized weight."""

    @staticmethod
    def __new__(cls, data, scale, dtype, reciprocal, source_dtype=None, block=None):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), dtype=dtype, device=data.device
        )

    def __init__(self, data, scale, dtype, reciprocal, source_dtype=None, block: int | None = None):
        self._data, self._scale, self._reciprocal = data, scale, reciprocal
        self._source_dtype = source_dtype or dtype
        self._block = block

    @staticmethod
    def for_recipe(data, scale, dtype, recipe, source_dtype=None) -> "Fp8GatheredWeight":
        """The gathered weight of ``recipe``'s forward weight cast (its square blocks, if any)."""
        block = recipe.output.b.block[0] if recipe.block_scaled else None
        return Fp8GatheredWeight(data, scale, dtype, recipe.reciprocal_scales, source_dtype, block)

    def _with(self, data=None, scale=None, dtype=None) -> "Fp8GatheredWeight":
        return Fp8GatheredWeight(
            self._data if data is None else data,
            self._scale if scale is None else scale,
            dtype or self.dtype,
            self._reciprocal,
            self._source_dtype,
            self._block,
        )

    def dequantize(self) -> torch.Tensor:
        """The weight as the FP8 GEMM sees it, in float32 (exactly what the emulation's own
        cast of the high-precision weight gives; ``reciprocal``: the recipe unscales by
        multiplying with the scale's reciprocal, as Primus-Turbo's kernels do)."""
        if self._block is not None:
            return dequantize_matrices(self._data, self._scale, (self._block, self._block))
        return dequantize(self._data, self._scale, self._reciprocal)

    def fp8_data(self) -> torch.Tensor:
        return self._data

    def scale(self) -> torch.Tensor:
        """The scale as :func:`~titan_primus.fsdp_fp8.quantize_weight` made it (what
        ``gathered_weight`` takes back): for square blocks, each block's scale_inv."""
        return self._scale

    def scale_inv(self) -> torch.Tensor:
        """What kernels that take scale inverses (Primus-Turbo's) receive: fl(1 / scale) in
        float32, or the blocks' scale_inv as the block quantizer made it."""
        return self._scale if self._block is not None else torch.reciprocal(self._scale)

    def __repr__(self):
        return f"Fp8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, fp8={self._data.dtype})"

    def __tensor_flatten__(self):
        return ["_data", "_scale"], (self.dtype, self._reciprocal, self._source_dtype, self._block)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Fp8GatheredWeight(inner["_data"], inner["_scale"], *meta)

    _VIEWS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        weight = args[0]
        kept = weight._kept_fp8(func, args, kwargs) if isinstance(weight, Fp8GatheredWeight) else None
        if kept is not None:
            return kept
        if func is torch.ops.aten.embedding.default and isinstance(weight, Fp8GatheredWeight):
            raise RuntimeError(
                "titan-primus: an embedding looked up a weight FSDP2 all-gathered in FP8 (a weight tied to an "
                "FP8 linear): it would read FP8-rounded values. Keep that linear out of FP8 all-gather (the "
                "converters do for TorchTitan's weight tying) or turn enable_fsdp_float8_all_gather off."
            )
        # Anything else (a norm for logging, a print) sees the dequantized weight.
        args, kwargs = tree_map_only(Fp8GatheredWeight, lambda t: t.dequantize().to(t.dtype), (args, kwargs))
        return func(*args, **kwargs)

    def _kept_fp8(self, func, args, kwargs) -> "Fp8GatheredWeight | None":
        """``func(self, ...)`` as an Fp8GatheredWeight where it changes no value, else None."""
        aten = torch.ops.aten
        # FSDP2 re-views the unsharded tensor with its original size and stride, nn.Parameter
        # detaches it, and DTensor's to_local (an expert weight under expert parallelism) views
        # it as itself: each is the tensor itself.
        if (
            func in self._VIEWS
            or (func is aten.view.default and tuple(args[1]) == tuple(self.shape))
            or (
                func is aten.as_strided.default
                and tuple(args[1]) == tuple(self.shape)
                and tuple(args[2]) == self.stride()
                and (args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)) in (0, None)
            )
        ):
            return self._with()
        if func is aten.transpose.int:
            dims = args[1:3]
            scale = self._scale if self._scale.dim() == 0 else self._scale.transpose(*dims)
            return self._with(self._data.transpose(*dims), scale)
        if (
            func is aten._to_copy.default
            and kwargs.get("dtype") == self._source_dtype
            and all(
                value in (None, False, torch.preserve_format, self.device, self.layout)
                for key, value in kwargs.items()
                if key != "dtype"
            )
        ):
            return self._with(dtype=self._source_dtype)
        pad_value = args[2] if len(args) > 2 else 0
        # Block scales would need new blocks for new rows: padded block-scaled weights (no
        # backend pads one) see the dequantized weight.
        if func is aten.constant_pad_nd.default and pad_value == 0 and min(args[1]) >= 0 and self._block is None:
            return self._zero_padded(args[1])
        return None

    def _zero_padded(self, pad) -> "Fp8GatheredWeight":
        """Zero padding (F.pad's ``pad``: pairs from the last dim): zero FP8 bytes (0x00 is +0 in
        every FP8 format), and a scale of 1 for the new rows of a per-row scale."""
        data = torch.nn.functional.pad(self._data.view(torch.uint8), pad).view(self._data.dtype)
        scale = self._scale
        if scale.dim():
            scale_pad = [p if scale.shape[-1 - i // 2] > 1 else 0 for i, p in enumerate(pad)]
            scale = torch.nn.functional.pad(scale, scale_pad, value=1.0)
        return self._with(data, scale)
