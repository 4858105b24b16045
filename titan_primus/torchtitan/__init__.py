"""The TorchTitan 0.3 adapter. With titan_primus.torchtitan02 (the 0.2.x one), the only part of
titan-primus that imports TorchTitan."""

from ..adapter_import import adapter_import_error

try:
    # 0.3's config-tree converter protocol; TorchTitan 0.2.x has a module-swap registry instead.
    from torchtitan.protocols.model import ModelConfigConverter  # noqa: F401

    from ..conversion import ConversionReport, LayerRoute
    from .activation_checkpoint import Fp8SelectiveAC, with_fp8_gemms_saved
    from .converter import Float8Converter
    from .modules import Fp8Linear, fp8_experts_class
except ImportError as e:
    raise adapter_import_error(
        e,
        adapter="titan_primus.torchtitan (Float8Converter)",
        line="0.3",
        verified="0.3.0",
        extra="torchtitan",
        line_module="torchtitan.protocols.model",
        instead="On TorchTitan 0.2.x use titan_primus.torchtitan02 through [experimental] custom_import",
    ) from e

__all__ = [
    "ConversionReport",
    "Float8Converter",
    "Fp8Linear",
    "Fp8SelectiveAC",
    "LayerRoute",
    "fp8_experts_class",
    "with_fp8_gemms_saved",
]
