"""The ``[titan_primus]`` TOML section, for TorchTitan 0.2.x's ``[job] custom_config_module``.

TorchTitan merges this ``JobConfig`` into its own, so the section's keys (and the matching
``--titan_primus.<option>`` command-line flags) are the fields of
:class:`~titan_primus.conversion.ConversionOptions`.
"""

from dataclasses import dataclass, field

from titan_primus.conversion import ConversionOptions

__all__ = ["JobConfig"]


@dataclass
class JobConfig:
    titan_primus: ConversionOptions = field(default_factory=ConversionOptions)
    """titan-primus FP8 converter options (used when [model] converters lists "titan_primus.float8")."""
