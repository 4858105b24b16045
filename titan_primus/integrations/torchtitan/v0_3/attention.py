"""TorchTitan 0.3's inner attention on Primus-Turbo, masks kept.

TorchTitan's seam is ``inner_attention`` (models/common/attention.py), and
``Decoder.get_attention_masks`` chooses the masks by the first layer's inner-attention config
type (BlockMask for FlexAttention, VarlenMetadata for VarlenAttention). So each replacement is a
subclass of a TorchTitan config whose masks it consumes:

- ``VarlenAttention.Config`` -> :class:`PrimusTurboVarlenAttention` (a subclass): the same
  VarlenMetadata, its cu_seqlens handed to ``flash_attn_varlen_func``, its window kept;
- ``FlexAttention.Config`` on a model whose masks are Decoder's own (causal + packed documents,
  ``_create_flex_attention_mask_for_document``) -> :class:`PrimusTurboVarlenAttention` too: the
  model then builds VarlenMetadata, the same mask as cu_seqlens (a BlockMask's mask_mod cannot be
  read back into cu_seqlens). A model with masks of its own (gpt_oss's sliding windows and sinks,
  qwen3_5) keeps TorchTitan's attention, flex or varlen, with the reason;
- ``ScaledDotProductAttention.Config`` (causal or full, no masks) -> :class:`PrimusTurboSDPA`.

Where the route says TorchTitan's own (another device, FP8 refused with ``attention`` off), the
config is left as it is.

A document-masked model the route made varlen gets its VarlenMetadata built on the host
(:class:`HostDocumentMasks`, installed by ``seams.build_document_masks_on_host``): TorchTitan builds
it from the positions already on the device, one ``nonzero`` per sequence and one ``.item()``, each a
host sync, where the flex masks it replaces built with none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torchtitan.models.common.attention import (
    FlexAttention,
    ScaledDotProductAttention,
    VarlenAttention,
    VarlenMetadata,
    create_varlen_metadata_for_document,
)
from torchtitan.models.common.decoder import Decoder

from titan_primus.attention import AttentionRoute, AttentionSite, attend
from titan_primus.attention.call import Documents

__all__ = [
    "HOST_DOCUMENT_MASKS",
    "HostDocumentMasks",
    "PrimusTurboSDPA",
    "PrimusTurboVarlenAttention",
    "convert_attention",
]

LSE_EPILOGUE = (
    "an LSE epilogue (out_transform, e.g. attention sinks): Primus-Turbo's returned LSE carries no gradient "
    "(its backward drops it), so the epilogue's gradients would be wrong"
)


def flash_window(window_size: tuple[int, int]) -> tuple[bool, tuple[int, int]]:
    """TorchTitan's VarlenAttention window (left, right; (-1, 0) causal, (W, 0) causal sliding,
    (-1, -1) full) as flash-attention's (causal, window_size): right 0 is causal, and a window
    without a left bound is none."""
    left, right = window_size
    causal = right == 0
    return causal, ((-1, -1) if left < 0 and (causal or right < 0) else (left, right))


def _no_epilogue(fqn: str, out_transform) -> None:
    if out_transform is not None:
        raise ValueError(f"titan-primus: {fqn} was routed to Primus-Turbo, but its model passes {LSE_EPILOGUE}")


class PrimusTurboVarlenAttention(VarlenAttention):
    """TorchTitan's VarlenAttention on Primus-Turbo's ``flash_attn_varlen_func`` (bf16), or FP8
    attention where the route says so (never with documents: :func:`fp8_attention_refusal`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(VarlenAttention.Config):
        attention_route: AttentionRoute = field(default=None)

    def __init__(self, config: Config):
        super().__init__(config)
        self.route = config.attention_route
        self.causal, self.flash_window = flash_window(config.window_size)

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, scale=None, out_transform=None, **kwargs):
        _no_epilogue(self.route.fqn, out_transform)
        documents = Documents(attention_masks.cu_seq_q, attention_masks.max_q)
        return attend(
            self.route,
            q_BLNH,
            k_BLNH,
            v_BLNH,
            scale=scale,
            causal=self.causal,
            window=self.flash_window,
            documents=documents,
        )


class PrimusTurboSDPA(ScaledDotProductAttention):
    """TorchTitan's ScaledDotProductAttention (causal or full, no masks) on Primus-Turbo's
    ``flash_attn_func`` or FP8 attention."""

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        attention_route: AttentionRoute = field(default=None)

    def __init__(self, config: Config):
        super().__init__(config)
        self.route = config.attention_route

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, is_causal=True, **kwargs):
        if attention_masks is not None:
            raise ValueError("ScaledDotProductAttention does not support attention_masks (as TorchTitan's own)")
        return attend(self.route, q_BLNH, k_BLNH, v_BLNH, scale=scale, causal=is_causal)


def _head_dims(attention_config) -> tuple[int, int] | None:
    """(query/key, value) head dims of an attention config: MLA's (deepseek_v3), else GQA's."""
    if hasattr(attention_config, "qk_nope_head_dim"):
        qk = attention_config.qk_nope_head_dim + attention_config.qk_rope_head_dim
        return qk, attention_config.v_head_dim
    head_dim = getattr(attention_config, "head_dim", None)
    if head_dim is None and getattr(attention_config, "dim", None) and getattr(attention_config, "n_heads", None):
        head_dim = attention_config.dim // attention_config.n_heads
    return (head_dim, head_dim) if head_dim else None


def _grouped(attention_config) -> bool:
    """Fewer key/value heads than query heads (GQAttention's ``n_kv_heads``)."""
    n_kv_heads = getattr(attention_config, "n_kv_heads", None)
    return n_kv_heads is not None and n_kv_heads != getattr(attention_config, "n_heads", n_kv_heads)


def _own_masks(model_config) -> str | None:
    """Why a model's masks are not known to be Decoder's causal + packed-document ones, if so."""
    owner = getattr(type(model_config), "_owner", None)
    masks = getattr(owner, "get_attention_masks", None)
    if owner is None or masks is Decoder.get_attention_masks:
        return None
    return (
        f"{owner.__name__} builds attention masks of its own (get_attention_masks), and such models pass "
        f"what Primus-Turbo cannot take (gpt_oss: sliding-window BlockMasks, and {LSE_EPILOGUE})"
    )


def _not_the_decoders(model_config, cls) -> dict[int, str]:
    """{id: reason} of the ``cls`` configs (flex or varlen) that are not the inner attention of
    the model's decoder layers: only those receive the masks ``get_attention_masks`` builds
    (a vision encoder's, kimi_k2_7's, gets a bidirectional padding BlockMask of its own)."""
    layers = getattr(model_config, "layers", None) if isinstance(model_config, Decoder.Config) else None
    decoders = {id(c) for layer in layers or () for _, c, _, _ in layer.traverse(cls)}
    owner = getattr(type(model_config), "_owner", type(model_config))
    return {
        id(config): (
            f"{fqn} is not in {owner.__name__}'s decoder layers, so its masks are not the decoder's "
            f"(causal, documents, window) that the route maps: kept as the model builds it (e.g. a vision "
            f"encoder's bidirectional padding mask)"
        )
        for fqn, config, _, _ in model_config.traverse(cls)
        if id(config) not in decoders
    }


def _with_route(config, new_cls, route: AttentionRoute, **fields_):
    kept = {f: getattr(config, f) for f in ("window_size",) if hasattr(config, f)}
    return new_cls(attention_route=route, **{**kept, **fields_})


def convert_attention(model_config, router, replace) -> object:
    """Route every inner attention of ``model_config`` (``router``: the converter's LayerRouter;
    ``replace(model_config, parent, attr, new)`` puts a config in place). Returns the config."""
    own_masks = _own_masks(model_config)
    kinds = (
        (PrimusTurboVarlenAttention.Config, VarlenAttention.Config, True),
        (PrimusTurboSDPA.Config, ScaledDotProductAttention.Config, False),
        (PrimusTurboVarlenAttention.Config, FlexAttention.Config, True),
    )
    for new_cls, cls, documents in kinds:
        foreign = _not_the_decoders(model_config, cls) if documents else {}
        for fqn, config, parent, attr in list(model_config.traverse(cls)):
            if isinstance(config, (PrimusTurboVarlenAttention.Config, PrimusTurboSDPA.Config)):
                continue
            window = getattr(config, "window_size", (-1, 0) if documents else (-1, -1))
            causal, flash = flash_window(window) if documents else (None, (-1, -1))
            site = AttentionSite(
                causal=causal,
                documents=documents,
                window=flash,
                head_dims=_head_dims(parent) if not isinstance(parent, list) else None,
                grouped=not isinstance(parent, list) and _grouped(parent),
                unmappable=(foreign.get(id(config)) or own_masks) if documents else None,
            )
            route = router.attention(fqn, site)
            if route is None or route.backend is None:
                continue
            new = _with_route(
                config, new_cls, route, **({"window_size": (-1, 0)} if cls is FlexAttention.Config else {})
            )
            model_config = replace(model_config, parent, attr, new)
    return model_config


def has_routed_documents(model_config) -> bool:
    """Whether ``model_config``'s decoder takes the document masks on the route (its first inner
    attention, which ``Decoder.get_attention_masks`` builds them for, is the route's varlen)."""
    inner = getattr(getattr(model_config, "first_attention", None), "inner_attention", None)
    return isinstance(inner, PrimusTurboVarlenAttention.Config)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # From pinned memory the copy is queued on the stream and the host goes on; from pageable
    # memory the host would wait for it.
    return t.to(device) if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


class HostDocumentMasks:
    """Document masks built on the host, for the batches of models that take them on the route.

    :meth:`add` runs where the trainer yields a batch from the dataloader, its tensors still on the
    CPU: TorchTitan's own ``create_varlen_metadata_for_document`` on the CPU positions (nothing to
    wait for there), then positions and offsets copied to the device without waiting. The trainer's
    own move of the batch then leaves the positions as they are (already there), and
    :meth:`take`, asked for the masks of those positions, returns what :meth:`add` built: the same
    VarlenMetadata TorchTitan would build from them on the device, without its ``B + 1`` syncs. Any
    other positions (validation, a model off the route) get TorchTitan's own, as before."""

    def __init__(self):
        self._built: dict[int, tuple[torch.Tensor, VarlenMetadata]] = {}

    def add(self, input_dict: dict, device: torch.device | str) -> None:
        device = torch.device(device)
        positions = input_dict.get("positions")
        if not isinstance(positions, torch.Tensor) or positions.device.type != "cpu":
            return
        on_device = _to_device(positions, device)
        if on_device.to(device) is not on_device:
            # The trainer's own move would copy them again (a CPU trainer on "cpu:0"), so the
            # decoder would never ask for these positions; and a CPU has no host sync to save.
            return
        masks = create_varlen_metadata_for_document(positions)
        offsets = _to_device(masks.cu_seq_q, device)
        input_dict["positions"] = on_device
        self._built[id(on_device)] = (on_device, masks._replace(cu_seq_q=offsets, cu_seq_k=offsets))

    def take(self, positions: torch.Tensor) -> VarlenMetadata | None:
        built = self._built.pop(id(positions), None)
        return built[1] if built is not None and built[0] is positions else None


HOST_DOCUMENT_MASKS = HostDocumentMasks()
