"""Why a TorchTitan adapter could not be imported, told by its real cause, with the fix.

Each adapter imports a TorchTitan module that exists on its own line only, so a failed import can
mean three things: TorchTitan is missing, the other line is installed, or TorchTitan itself
failed to import something (Triton is missing under a CPU-only torch, torch is too old). The
third must never read as the second.
"""

from __future__ import annotations

from importlib import metadata, util
from pathlib import Path
import re
import traceback

import torch

__all__ = ["adapter_import_error", "installed_version", "unsupported_torchtitan"]


def adapter_import_error(
    error: ImportError, *, adapter: str, line: str, verified: str, extra: str, line_module: str, instead: str
) -> ImportError:
    """The ImportError ``adapter`` raises when importing TorchTitan failed with ``error``.

    ``verified``: the TorchTitan release of ``line`` the adapter was verified on; ``line_module``
    is the TorchTitan module only ``line`` has; ``instead`` tells what to use on the other line.
    """
    missing = error.name or ""
    if missing == "torchtitan":
        return ImportError(
            f"{adapter} needs TorchTitan {line}, which is not installed: pip install 'titan-primus[{extra}]'"
        )
    refusal = unsupported_torchtitan()
    if refusal and missing.startswith("torchtitan."):
        return ImportError(refusal)
    version = installed_version("torchtitan") or "of unknown version"
    of_this_line = version.startswith(line.removesuffix(".x"))
    if not of_this_line and (
        missing == line_module or (line_module.startswith(f"{missing}.") and missing.startswith("torchtitan."))
    ):
        return ImportError(
            f"{adapter} is the adapter for TorchTitan {line}, which has {line_module}; the installed "
            f"TorchTitan ({version}) does not. {instead}"
        )
    if missing.startswith("torchtitan") and _in_titan_primus(error):
        # TorchTitan imported, but what titan-primus takes from it is not where this line had it:
        # an upstream move or rename, which no reinstall of TorchTitan repairs.
        return ImportError(
            f"{adapter}: TorchTitan {version} lacks what titan-primus imports from it, {_where(error)}: "
            f"{type(error).__name__}: {error}. The adapter was verified on TorchTitan {verified}; this TorchTitan "
            f"moved or renamed it. Fix: install TorchTitan {verified} (pip install 'torchtitan=={verified}'), "
            f"or a titan-primus that supports TorchTitan {version}"
        )
    return ImportError(
        f"{adapter}: importing TorchTitan {version} failed inside it, {_where(error)}: "
        f"{type(error).__name__}: {error}. Fix: {_fix(missing)}"
    )


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, None when it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


# The first TorchTitan line without an adapter, and the 0.3 module it moved (PR #4630: to
# torchtitan.quantization); docs/torchtitan04.md lists every seam.
UNSUPPORTED_LINE = (0, 4)
MOVED_IN_UNSUPPORTED_LINE = ("components", "quantization")


def unsupported_torchtitan() -> str | None:
    """The one-line refusal when the installed TorchTitan is of a line no adapter supports yet
    (0.4 or later, without 0.3's ``torchtitan.components.quantization``), else None. Reads the
    version and the package's folders only: nothing of TorchTitan is imported. A 0.4 pre-release
    that still has the 0.3 layout (TorchTitan main of 2026-08-21, which the canary runs) passes."""
    version = installed_version("torchtitan")
    numbers = re.match(r"(\d+)\.(\d+)", version or "")
    if not numbers or tuple(map(int, numbers.groups())) < UNSUPPORTED_LINE:
        return None
    spec = util.find_spec("torchtitan")
    folders = spec.submodule_search_locations if spec else None
    if folders and any(Path(folder, *MOVED_IN_UNSUPPORTED_LINE).is_dir() for folder in folders):
        return None
    return (
        f"TorchTitan {version} is not yet supported: titan-primus has adapters for TorchTitan 0.3 and 0.2.x only "
        f"(0.4 moved the seams they use, docs/torchtitan04.md); pin TorchTitan 0.3: pip install 'torchtitan>=0.3,<0.4'"
    )


def _failed_frame(error: BaseException):
    """The frame of the import statement that failed (importlib's own frames skipped), or None."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith("<")]
    return frames[-1] if frames else None


def _in_titan_primus(error: BaseException) -> bool:
    """Whether the import that failed is one of titan-primus's own (its adapter importing TorchTitan)."""
    frame = _failed_frame(error)
    return frame is not None and Path(frame.filename).resolve().is_relative_to(_PACKAGE)


_PACKAGE = Path(__file__).resolve().parents[3]  # titan_primus/


def _where(error: BaseException) -> str:
    """The file and line of the import statement that failed, from its package down."""
    frame = _failed_frame(error)
    if frame is None:
        return "at import"
    path = Path(frame.filename).resolve()
    if path.is_relative_to(_PACKAGE):
        # titan-primus's own file: named by package, as titan_primus/integrations/torchtitan/v0_3/converter.py, which
        # cut at its "torchtitan" folder would read as one of TorchTitan's.
        parts = ("titan_primus", *path.relative_to(_PACKAGE).parts)
    else:
        parts = path.parts
        # From the package down (torchtitan/models/...), wherever TorchTitan is installed or checked out.
        if "torchtitan" in parts:
            parts = parts[len(parts) - 1 - parts[::-1].index("torchtitan") :]
    return f"in {'/'.join(parts).lstrip('/')}, line {frame.lineno}"


def _fix(missing: str) -> str:
    top = missing.split(".")[0]
    if top == "triton":
        if torch.version.hip:
            return (
                "this ROCm torch brings Triton as the distribution pytorch-triton-rocm: reinstall "
                "that one (the registry's `triton` is not the ROCm build)"
            )
        if torch.version.cuda:
            return "this CUDA torch declares its Triton: pip install the triton version torch requires (pip check names it)"
        return "CPU-only torch wheels bring no Triton and TorchTitan imports it: pip install triton"
    if top == "torch":
        return (
            f"this TorchTitan needs a newer torch than {torch.__version__} (docs/install.md: minimum "
            f"versions per TorchTitan line)"
        )
    if top:
        return f"install (or repair) the distribution that provides the module {top!r}"
    return "repair the TorchTitan installation (pip check lists what is missing or mismatched)"
