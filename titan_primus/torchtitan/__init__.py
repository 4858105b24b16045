"""The TorchTitan 0.3 adapter. With titan_primus.torchtitan02 (the 0.2.x one), the only part of
titan-primus that imports TorchTitan."""

from ..cli.doctor import installed_version

try:
    # 0.3's config-tree converter protocol; TorchTitan 0.2.x has a module-swap registry instead.
    from torchtitan.protocols.model import ModelConfigConverter  # noqa: F401
except ImportError as e:
    raise ImportError(
        f"titan_primus.torchtitan (Float8Converter) is the adapter for TorchTitan 0.3, which has "
        f"torchtitan.protocols.model.ModelConfigConverter; the installed TorchTitan "
        f"({installed_version('torchtitan') or 'none'}) does not. On TorchTitan 0.2.x use "
        f"titan_primus.torchtitan02 through [experimental] custom_import"
    ) from e

from ..conversion import ConversionReport, LayerRoute
from .converter import Float8Converter
from .modules import Fp8Linear, fp8_experts_class

__all__ = ["ConversionReport", "Float8Converter", "Fp8Linear", "LayerRoute", "fp8_experts_class"]
