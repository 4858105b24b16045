"""The TorchTitan 0.3 adapter: the only part of titan-primus that imports TorchTitan."""

from .converter import ConversionReport, Float8Converter, LayerRoute
from .modules import Fp8Linear, fp8_experts_class

__all__ = ["ConversionReport", "Float8Converter", "Fp8Linear", "LayerRoute", "fp8_experts_class"]
