"""The TorchTitan 0.3 adapter's public names (built in titan_primus.integrations.torchtitan.v0_3).
With titan_primus.torchtitan02 (the 0.2.x one), the adapters users import."""

from ..integrations.torchtitan.common.imports import adapter_import_error

try:
    from ..integrations.torchtitan.v0_3.converter import Float8Converter
    from ..conversion import ConversionReport, LayerRoute
    from ..integrations.torchtitan.v0_3.activation_checkpoint import Fp8SelectiveAC, with_fp8_gemms_saved
    from ..integrations.torchtitan.v0_3.modules import Fp8Linear, fp8_experts_class
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
