"""The records of the results files, typed: one frozen dataclass per kind of row (and the
environment block, and validate's result per config), each field with its JSON type and meaning.
The producers (parity, bench, ``bench --memory``, validate, every ``environment``) write them
through these classes, so a row cannot carry a key the schema does not declare nor lack one it does, and
docs/json-schema.md's row tables are generated from them (:func:`write_schema`;
tests/unit/test_json_schema_doc.py fails when the page is stale)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

__all__ = [
    "BenchRow",
    "Environment",
    "GpuPeakRow",
    "MemoryRow",
    "ParityRow",
    "ResultRow",
    "SCHEMA_TABLES",
    "ValidateResult",
    "schema_table",
    "write_schema",
]


def described(json_type: str, meaning: str, default: Any = MISSING, *, omitted_when_none: bool = False) -> Any:
    """A record field: its JSON type and meaning as docs/json-schema.md states them;
    ``omitted_when_none``: the key is left out of the JSON where the value is None."""
    metadata = {"json_type": json_type, "meaning": meaning, "omitted_when_none": omitted_when_none}
    return field(default=default, metadata=metadata)


@dataclass(frozen=True, kw_only=True)
class Record:
    """A row of a results file (:meth:`from_fields` / :meth:`to_json`)."""

    @classmethod
    def from_fields(cls, row: Mapping[str, Any]):
        """The record of ``row`` (a producer's dict); a key the record does not declare, or one
        it needs and ``row`` lacks, is a ValueError naming it (a producer's bug, not the user's)."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(row) - names)
        if unknown:
            raise ValueError(f"{cls.__name__} has no field {', '.join(unknown)}: declare it in diagnostics/records.py")
        try:
            return cls(**row)
        except TypeError as e:
            raise ValueError(f"{cls.__name__}: {e}") from None

    def to_json(self) -> dict[str, Any]:
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if not (f.metadata["omitted_when_none"] and getattr(self, f.name) is None)
        }


@dataclass(frozen=True, kw_only=True)
class ResultRow(Record):
    """The fields every row of parity, bench and ``bench --memory`` has."""

    REQUIRED: ClassVar[tuple[str, ...]] = ("op", "case", "backend", "status", "reason")
    """What a file's every row must have for ``report`` to read it (replay rows too)."""

    op: str = described("string", '`"linear"`, `"grouped_mm"` or (parity, bench) `"attention"`')
    case: str = described(
        "string",
        "the shape case (parity: `m255`, `empty_groups`, `fnuz_range`, ..., attention `causal`, `full`, "
        "`gqa_causal`, `dv_differs`, `gqa_dv_differs`; bench: `llama3_8b.w1_w3`, ..., `llama3_8b.attention`, "
        "`deepseek_v3.attention`; memory: the path, with `, FP8 all-gather` when the weight is the one FSDP2 "
        "gathered in FP8)",
    )
    shape: str = described(
        "string",
        "its dimensions, e.g. `M=255 K=512 N=384`, `E=8 rows=2048 K=512 N=256 groups=[...]`, attention "
        "`B=1 S=128 Hq=4 Hkv=2 D=64 Dv=64 causal` (q/k and v head dims); memory: the audited GEMM",
    )
    backend: str = described(
        "string", 'a registered backend name (third-party plugins included); in bench also `"bf16"`, the baseline'
    )
    recipe: str | None = described(
        "string or null",
        "`tensorwise`, `rowwise`, `rowwise_with_gw_hp`, `mxfp8`, `blockwise`; null for the bf16 baseline; "
        "attention rows: `fp8_blockwise64` (FP8 attention's one definition, Primus-Turbo's "
        "`Float8QuantConfig(BLOCKWISE, block_size=64)`), and in bench `bf16` for Primus-Turbo's `flash_attn_func`",
    )
    definition: str | None = described(
        "string or null", "the recipe definition the backend runs (`torchao`, `primus_turbo`); null when it did not run"
    )
    status: str = described(
        "string", "parity: `pass`, `fail`, `error`, `skipped`; bench and memory: `ok`, `error`, `skipped`"
    )
    reason: str = described("string", 'why it was skipped, what failed, or the error; `""` on success')


@dataclass(frozen=True, kw_only=True)
class ParityRow(ResultRow):
    """One (op, recipe, case, backend) cell of parity's matrix."""

    device: str = described("string", "profile arch the row ran under")
    routed: bool = described(
        "bool", 'this is the backend `backend="auto"` picks for this op, recipe, profile and shape'
    )
    checks: list[dict] = described(
        "list",
        "`{quantity, against, sqnr_db, threshold_db, passed}`: `quantity` is `out`, `grad_input` or "
        "`grad_weight` (attention rows: `out`, `dq`, `dk`, `dv`, against fp32 SDPA of the same bf16 inputs at "
        '20 dB; Primus-Turbo\'s also against `"emulated"` at 40); `against` is `"fp32"` (the fp32 reference '
        "from the same inputs) or the name of the backend that ran the same definition before it (the "
        "emulation, usually); `threshold_db` follows from how the recipe casts that GEMM's operands",
    )
    problems: list[str] = described(
        "list of strings",
        "non-finite outputs (attention: out, dq, dk or dv); non-zero output or gradient in rows past the last group",
    )
    differs_from: list[str] = described(
        "list of strings",
        '`"backend (definition)"` of runs that define the recipe differently: not compared with this one',
    )


@dataclass(frozen=True, kw_only=True)
class BenchRow(ResultRow):
    """One (op, recipe, case, backend) timing of bench."""

    flops: int = described(
        "int",
        "forward+backward FLOPs: 3 GEMMs of `2*M*K*N`; attention: 3.5x the forward's `2*B*Hq*S*S*(D+Dv)`, "
        "halved for causal (FlashAttention's convention, backward 2.5x forward)",
    )
    ms: float | None = described("number or null", "mean milliseconds per forward+backward")
    tflops: float | None = described("number or null", "`flops / ms / 1e9`")
    speedup_vs_bf16: float | None = described(
        "number or null",
        "bf16 ms / this ms for the same shape (>1: faster than bf16); for attention the baseline (`backend` "
        '`"bf16"`) is torch\'s SDPA in bf16',
    )
    fraction_of_peak: float | None = described(
        "number or null",
        "`tflops` / the dense datasheet peak (FP8 peak for FP8 backends, BF16 for the baseline and for "
        "Primus-Turbo's bf16 attention)",
    )
    stock_of: str | None = described(
        "string (stock rows only)",
        "the backend whose upstream entry point this row times, as a user of that library alone calls it "
        '(`backend` is `"<stock_of> (stock)"`: stock TorchAO beside the `torchao` backend)',
        None,
        omitted_when_none=True,
    )
    stock_path: str | None = described(
        "string (stock rows only)",
        "that entry point: `TorchAO convert_to_float8_training` (linears), `TorchAO Float8TrainingOpConfig "
        "grouped GEMM` (`_quantize_then_scaled_grouped_mm`, as TorchTitan's FP8 MoE converter runs it)",
        None,
        omitted_when_none=True,
    )
    titan_primus_vs_stock: float | None = described(
        "number (stock rows only)",
        "the `stock_of` row's ms / this row's ms, same shape and recipe (<1: titan-primus faster)",
        None,
        omitted_when_none=True,
    )
    bitwise_equal_to_titan_primus: bool | None = described(
        "bool (stock rows only)",
        "output, grad_input and grad_weight of one forward+backward on the same seeded inputs are bitwise "
        "those of the `stock_of` row (compiled where `mode` is `torch.compile`)",
        None,
        omitted_when_none=True,
    )


@dataclass(frozen=True, kw_only=True)
class MemoryRow(ResultRow):
    """One audited GEMM of ``bench --memory``: what its forward keeps for backward."""

    path: str = described("string", "`eager` or `compiled` (`torch.compile(fullgraph=True)`)")
    fp8_all_gather: bool = described("bool", "the weight is FSDP2's FP8-gathered one (else a bf16 parameter)")
    kept: dict[str, int] | None = described(
        "object or null",
        "bytes kept from forward to backward by kind: `activation_fp8`, `activation_hp`, `parameter` (the "
        "weight's own or FSDP2-gathered storage: FSDP-managed), `weight_copy` (other weight-shaped storage), "
        "`other` (scales, offsets)",
    )
    kept_bytes: int | None = described("int or null", "all of `kept` but `parameter`")
    input_by_reference: bool | None = described("bool or null", "the layer's input tensor itself is kept")


@dataclass(frozen=True, kw_only=True)
class GpuPeakRow(Record):
    """One entry of ``bench --memory``'s ``gpu_peak`` (on a GPU): the peak of converted blocks
    under FSDP2, measured."""

    backend: str = described("string", '`"bf16"` (the blocks unconverted) or a registered backend')
    recipe: str | None = described("string or null", "the recipe; null for bf16")
    status: str = described("string", "`ok`, `error`, `skipped`")
    reason: str = described("string", 'why it was skipped, or the error; `""` on success')
    peak_bytes: int | None = described("int or null", "the measured peak of the blocks' forward and backward")
    vs_bf16: float | None = described(
        "number or null", "`peak_bytes` / bf16's; null in the bf16 row and where either did not run", None
    )


@dataclass(frozen=True, kw_only=True)
class Environment(Record):
    """Where and with what a run happened: every results file's ``environment`` and ``doctor
    --json``'s (validate's adds ``device_name`` and ``primus_turbo_build``)."""

    date: str = described("string", "ISO 8601, UTC, seconds (`2026-11-30T04:37:50+00:00`)")
    host: str = described("string", "`platform.node()`")
    platform: str = described("string", "`platform.platform()`")
    gpus_visible: int = described("int", "`torch.cuda.device_count()` (ROCm GPUs count too), 0 without a GPU")
    versions: dict[str, str | None] = described(
        "object",
        "`python`, `titan-primus`, `torch`, `torchtitan`, `torchao`, `primus-turbo` (installed distribution "
        "versions, `null` when absent), `torch HIP build`, `torch CUDA build` (`torch.version.hip` / `.cuda`, "
        "`null` when not that build)",
    )
    device: dict[str, Any] = described(
        "object",
        "the device profile the run used: `kind` (`cpu`/`cuda`/`rocm`), `arch` (`cpu`, `sm90`, `gfx942`, ...), "
        "`name`, `e4m3`, `e5m2` (FP8 dtypes, e.g. `float8_e4m3fnuz`), `fp8_hardware`, `mi300_class`, "
        "`detected` (false for a named profile chosen with `--device`), `description`",
    )


@dataclass(frozen=True, kw_only=True)
class ValidateResult(Record):
    """One config of ``titan-primus validate``: its four runs and their verdicts."""

    REQUIRED: ClassVar[tuple[str, ...]] = ("config", "module", "runs", "verdicts")
    """What each result of a validate file must have for ``report`` and ``--rejudge`` to read it."""

    config: str = described(
        "string",
        "the stock TorchTitan config of the bf16 runs (TorchTitan 0.2.x: the job's TOML as given)",
    )
    module: str = described("string", "the model of the bf16 runs (TorchTitan 0.2.x: the TOML's `[model] name`)")
    fp8_config: str = described(
        "string",
        "the config of the FP8 runs (`--module titan_primus`), e.g. `llama3_debugmodel_fp8` (0.2.x: the same "
        "TOML, the converter added)",
    )
    steps: int | None = described("int or null", "training steps (null: the config's own)")
    seq_len: int | None = described("int or null", "`training.seq_len` (null: the config's own)")
    batch: int | None = described("int or null", "`training.local_batch_size` (null: the config's own)")
    recipe: str = described("string", "the FP8 recipe")
    overrides: list[str] = described("list of strings", "trainer arguments given after `--`")
    fp8_options: dict[str, Any] = described(
        "object",
        "converter options of the FP8 runs only (`backend`, `fp8_dispatch`, `filter_fqns`, `attention`, "
        "`fp8_attention`, where given)",
    )
    runs: dict[str, dict] = described("object", "`bf16`, `fp8`, `seed_floor`, `last_bit_floor`, each a run (below)")
    routing: str | None = described(
        "string or null", "titan-primus's routing summary of the FP8 run, as the converter logged it"
    )
    floors: dict[str, dict] = described(
        "object",
        '`seed` (seed_floor vs bf16), `last_bit` (last_bit_floor vs fp8): each `{"loss": gap, "grad_norm": gap}` '
        "(below)",
    )
    gaps: dict[str, dict] = described("object", '`fp8_vs_bf16`: `{"loss": gap, "grad_norm": gap}`')
    verdicts: list[dict] = described(
        "list",
        "`name`, `status` (`pass`/`fail`), `value`, `bound` (fractions or counts; null where the verdict has "
        "none), `text` (the verdict with its figures, as printed)",
    )
    baseline: dict | None = described(
        "object or absent",
        "with `--baseline`: `config` (the baseline's config compared), `runs` (the baseline's `bf16` and `fp8` "
        "steps, for the plot)",
        None,
        omitted_when_none=True,
    )


SCHEMA_TABLES: dict[str, type[Record]] = {
    "Environment": Environment,
    "ResultRow": ResultRow,
    "ParityRow": ParityRow,
    "BenchRow": BenchRow,
    "MemoryRow": MemoryRow,
    "GpuPeakRow": GpuPeakRow,
    "ValidateResult": ValidateResult,
}
"""The tables docs/json-schema.md holds, by the name its markers give."""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def schema_table(record: type[Record]) -> str:
    """The markdown table of ``record``'s own fields (a row kind's table lists what it adds to
    :class:`ResultRow`'s)."""
    inherited = (
        {f.name for f in fields(ResultRow)} if record is not ResultRow and issubclass(record, ResultRow) else set()
    )
    lines = ["| key | type | meaning |", "|---|---|---|"]
    lines += [
        f"| `{f.name}` | {f.metadata['json_type']} | {_cell(f.metadata['meaning'])} |"
        for f in fields(record)
        if f.name not in inherited
    ]
    return "\n".join(lines)


_BLOCK = re.compile(
    r"(<!-- generated from titan_primus\.diagnostics\.records\.(\w+) -->\n)(.*?)(\n<!-- end generated -->)", re.S
)


def schema_page(text: str) -> str:
    """``text`` (docs/json-schema.md) with each generated table made again from its record."""
    return _BLOCK.sub(lambda m: m[1] + schema_table(SCHEMA_TABLES[m[2]]) + m[4], text)


def write_schema(path: str | Path) -> None:
    path = Path(path)
    path.write_text(schema_page(path.read_text()))
