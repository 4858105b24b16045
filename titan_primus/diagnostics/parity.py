"""What ``titan-primus parity`` computes: do the FP8 backends on this machine compute what they should?

For each op (linear, grouped GEMM) x recipe x shape case x registered backend, forward and
backward run on seeded inputs, and the SQNR (:func:`titan_primus.sqnr`) of out, grad_input and
grad_weight is measured against an fp32 reference computed from the same inputs, and between
backends that implement the same recipe definition.

Thresholds, fp32 references and the same-definition comparison are the core's
(:mod:`titan_primus.numerics`): per GEMM vs fp32, and 40 dB between two runs of one recipe
definition (whole-tensor SQNR here; the sentinel adds a row floor). Where two backends define a
recipe differently (TorchAO rounds rowwise scales to powers of two, Primus-Turbo does not), they
are not compared with each other; each is compared with fp32, and with the emulated backend
running its own definition (the emulation reproduces every definition).
Besides the thresholds, every output must be finite and rows of a grouped GEMM past the last
group must get exactly zero output and gradient.

FP8 attention (Primus-Turbo's ``flash_attn_fp8_func`` definition, blockwise 64) has no recipes:
per attention case (causal, full, GQA, q/k and v head dims differing), the emulation always and Primus-Turbo where it is usable
run it through the converter's own call (:func:`titan_primus.attention.attend`); out, dq, dk and
dv are compared with fp32 SDPA of the same bf16 inputs (20 dB), and Primus-Turbo's with the
emulation's (40 dB, the same definition).

Where cases run: under the device profile asked for (default: the detected device); tensors live
on this machine's GPU if it has one, else on the CPU. The fnuz-range case needs FNUZ formats
(gfx942): on any other device it runs under the gfx942 profile with the emulation only, since
real kernels there use their own device's formats. A backend that raises under a named profile
that is not this machine's hardware is listed as skipped with the error; on the detected device
it is a failure.
"""

from __future__ import annotations

import time
import zlib
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from itertools import combinations

import torch

from .. import registry
from ..attention import AttentionSite, attend, attention_backends, attention_refusal, backend_route, route_attention
from ..device import DeviceProfile, device_profile
from ..numerics import (
    ATTENTION_QUANTITIES,
    E4M3_BAR_DB,
    E5M2_BAR_DB,
    FP8_ATTENTION_BAR_DB,
    HIGH_PRECISION_BAR_DB,
    QUANTITIES,
    SAME_DEFINITION_BAR_DB,
    compare_quantities,
    fp32_bars,
    make_offsets,
    reference_attention,
    reference_grouped,
    reference_linear,
    run_attention,
    run_grouped,
    run_linear,
    sqnrs,
)
from ..ops import fp8_grouped_mm, fp8_linear
from ..recipes import RECIPE_NAMES, Fp8Recipe
from ..routing import BackendUnavailableError, select_backend
from .environment import ATTENTION_RECIPE, describe_error, environment, why_not
from .records import ParityRow
from .results import db_value, document, format_db

__all__ = [
    "DEFAULT_ATTENTION_CASES",
    "DEFAULT_CASES",
    "oracle",
    "QUICK_ATTENTION_CASES",
    "QUICK_CASES",
    "AttentionCase",
    "Check",
    "GroupedCase",
    "LinearCase",
    "Row",
    "differing_definitions",
    "parity_document",
    "parity_settings",
    "require_problems",
    "run_matrix",
]

FNUZ_PROFILE = "gfx942"


def oracle() -> str | None:
    """The name of the registered reference backend (the emulation: it runs every definition
    everywhere), the oracle the others are compared with; None where none is registered."""
    reference = registry.reference_backend()
    return reference.name if reference else None


# --- shape cases ---------------------------------------------------------------------------

_NORMAL = (1.0, 0.05, 1.0)  # std of (input, weight, grad_output)
# Far beyond e4m3fnuz's 240 (and e4m3fn's 448): an unclamped cast to fnuz is NaN in eager PyTorch.
_FNUZ_RANGE = (1000.0, 500.0, 1e5)


def _generator(name: str) -> torch.Generator:
    # Seeded by the case name: every recipe and backend sees the same inputs, in any order.
    return torch.Generator().manual_seed(zlib.crc32(name.encode()))


def unbalanced_counts(total: int, groups: int, seed: int) -> tuple[int, ...]:
    """Group sizes whose shares are 0.2 + 0.8 * U(0, 1), as Primus-Turbo's grouped GEMM tests draw them."""
    shares = 0.2 + 0.8 * torch.rand(groups, generator=torch.Generator().manual_seed(seed))
    counts = (shares / shares.sum() * total).floor().to(torch.int64)
    counts[-1] += total - counts.sum()
    return tuple(counts.tolist())


@dataclass(frozen=True, kw_only=True)
class _Case:
    name: str
    k: int
    n: int
    why: str
    scales: tuple[float, float, float] = _NORMAL
    fnuz: bool = False
    """Run under FNUZ formats (the gfx942 profile where the device is not FNUZ)."""

    def problems(self, inputs, outputs) -> list[str]:
        return _non_finite(outputs)


@dataclass(frozen=True, kw_only=True)
class LinearCase(_Case):
    m: int
    op = "linear"

    def shape(self) -> str:
        return f"M={self.m} K={self.k} N={self.n}"

    def inputs(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        gen = _generator(self.name)
        sx, sw, sg = self.scales
        x = (torch.randn(self.m, self.k, generator=gen) * sx).bfloat16()
        weight = torch.randn(self.n, self.k, generator=gen) * sw  # fp32 master weight
        bias = torch.randn(self.n, generator=gen)
        grad_out = (torch.randn(self.m, self.n, generator=gen) * sg).bfloat16()
        return tuple(t.to(device) for t in (x, weight, bias, grad_out))

    def run(self, inputs, recipe: Fp8Recipe | None, backend: str, device: DeviceProfile):
        """(out, grad_input, grad_weight); ``recipe=None`` is the fp32 reference."""
        if recipe is None:
            return reference_linear(*inputs)[:3]

        def fn(x, w, b):
            return fp8_linear(x, w, b, recipe=recipe, backend=backend, device=device)

        return run_linear(fn, *inputs)[:3]


@dataclass(frozen=True, kw_only=True)
class GroupedCase(_Case):
    counts: tuple[int, ...]
    trailing: int = 0
    op = "grouped_mm"

    def shape(self) -> str:
        trailing = f" +{self.trailing} trailing" if self.trailing else ""
        return (
            f"E={len(self.counts)} rows={sum(self.counts)}{trailing} K={self.k} N={self.n} groups={list(self.counts)}"
        )

    def inputs(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        gen = _generator(self.name)
        rows = sum(self.counts) + self.trailing
        sa, sw, sg = self.scales
        A = (torch.randn(rows, self.k, generator=gen) * sa).bfloat16()
        W = (torch.randn(len(self.counts), self.n, self.k, generator=gen) * sw).bfloat16()  # [E, N, K]
        grad_out = (torch.randn(rows, self.n, generator=gen) * sg).bfloat16()
        return A.to(device), W.to(device), make_offsets(self.counts).to(device), grad_out.to(device)

    def run(self, inputs, recipe: Fp8Recipe | None, backend: str, device: DeviceProfile):
        """(out, grad_A, grad_W); ``recipe=None`` is the fp32 reference."""
        if recipe is None:
            return reference_grouped(*inputs)

        def fn(A, B_t, offs):
            return fp8_grouped_mm(A, B_t, offs, recipe=recipe, backend=backend, device=device)

        return run_grouped(fn, *inputs)

    def problems(self, inputs, outputs) -> list[str]:
        found = super().problems(inputs, outputs)
        end = sum(self.counts)
        out, grad_A, _ = outputs
        if self.trailing and (out[end:].any() or grad_A[end:].any()):
            found.append(f"rows past offs[-1] ({self.trailing}) got non-zero output or gradient")
        return found


def _non_finite(outputs, quantities=QUANTITIES) -> list[str]:
    return [f"{q} has NaN/inf" for q, t in zip(quantities, outputs) if not torch.isfinite(t).all()]


_M_NOT_16 = "M not a multiple of 16, a shape Primus-Turbo's own tests use"
_FNUZ_WHY = "values far beyond e4m3fnuz's 240 on the gfx942 formats: must saturate, never NaN"

DEFAULT_CASES = (
    LinearCase(name="m255", m=255, k=512, n=384, why=_M_NOT_16),
    LinearCase(name="m507", m=507, k=384, n=512, why=_M_NOT_16),
    LinearCase(name="m512", m=512, k=512, n=512, why="aligned baseline"),
    LinearCase(
        name="k_unaligned",
        m=64,
        k=120,
        n=72,
        why="K and N not multiples of 16: FP8 kernels refuse it, the emulation runs it",
    ),
    LinearCase(name="fnuz_range", m=128, k=256, n=256, why=_FNUZ_WHY, scales=_FNUZ_RANGE, fnuz=True),
    GroupedCase(
        name="unbalanced",
        counts=unbalanced_counts(2048, 8, seed=1),
        k=512,
        n=256,
        why="unbalanced groups (Primus-Turbo's draw)",
    ),
    GroupedCase(
        name="empty_groups",
        counts=(0, 300, 0, 517, 1, 0, 230, 0),
        k=256,
        n=256,
        why="empty groups, first and last included",
    ),
    GroupedCase(
        name="trailing_rows",
        counts=(128, 64, 0, 192),
        trailing=48,
        k=256,
        n=128,
        why="rows past offs[-1], as TorchTitan's padding dispatcher leaves",
    ),
    GroupedCase(name="one_group", counts=(777,), k=256, n=128, why="a single group (G=1)"),
    GroupedCase(name="32_groups", counts=unbalanced_counts(4096, 32, seed=2), k=256, n=128, why="32 unbalanced groups"),
    GroupedCase(
        name="fnuz_range", counts=(40, 0, 88), trailing=8, k=128, n=128, why=_FNUZ_WHY, scales=_FNUZ_RANGE, fnuz=True
    ),
)

QUICK_CASES = (
    LinearCase(name="m255", m=255, k=64, n=48, why=_M_NOT_16),
    LinearCase(name="fnuz_range", m=32, k=64, n=32, why=_FNUZ_WHY, scales=_FNUZ_RANGE, fnuz=True),
    GroupedCase(
        name="empty_groups_trailing_rows",
        counts=(9, 0, 21, 6),
        trailing=5,
        k=64,
        n=32,
        why="an empty group and rows past offs[-1]",
    ),
)


@dataclass(frozen=True, kw_only=True)
class AttentionCase:
    name: str
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    causal: bool
    why: str
    batch: int = 1
    op = "attention"

    def shape(self) -> str:
        mask = "causal" if self.causal else "full"
        return f"B={self.batch} S={self.seq} Hq={self.heads} Hkv={self.kv_heads} D={self.head_dim} Dv={self.v_head_dim} {mask}"

    def inputs(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """bf16 bshd q, k, v and the output's gradient."""
        gen = _generator(f"attention {self.name}")
        B, S = self.batch, self.seq
        dims = ((self.heads, self.head_dim), (self.kv_heads, self.head_dim), (self.kv_heads, self.v_head_dim))
        q, k, v = (torch.randn(B, S, h, d, generator=gen).bfloat16() for h, d in dims)
        grad_out = torch.randn(B, S, self.heads, self.v_head_dim, generator=gen).bfloat16()
        return tuple(t.to(device) for t in (q, k, v, grad_out))

    def site(self) -> AttentionSite:
        return AttentionSite(
            causal=self.causal, head_dims=(self.head_dim, self.v_head_dim), grouped=self.kv_heads != self.heads
        )

    def run(self, inputs, backend: str | None, device: DeviceProfile):
        """(out, dq, dk, dv) of FP8 attention on ``backend``; ``backend=None`` is the fp32 reference."""
        if backend is None:
            return reference_attention(*inputs, causal=self.causal)
        route = backend_route(self.name, backend, fp8=True, device=device, reason="parity")
        return run_attention(lambda q, k, v: attend(route, q, k, v, scale=None, causal=self.causal), *inputs)

    def problems(self, inputs, outputs) -> list[str]:
        return _non_finite(outputs, ATTENTION_QUANTITIES)


_GQA_WHY = "grouped-query attention (Hq = 2 Hkv, as Llama3's 32 q / 8 kv heads): dk, dv sum over each group"
_DV_WHY = "q/k and v head dims differ, as DeepSeek-V3's MLA (192 / 128)"
_GQA_DV_WHY = (
    "grouped-query attention with q/k and v head dims differing: Primus-Turbo's FP8 backward got dk and dv "
    "wrong there under the Triton interpreter (every build from v0.3.1 to v0.4.1.dev26, gfx942 and gfx950), "
    "so routing refuses it; parity shows the refusal"
)


def _attention_cases(seq: int, heads: int, head_dim: int) -> tuple[AttentionCase, ...]:
    case = partial(AttentionCase, seq=seq, heads=heads, kv_heads=heads, head_dim=head_dim, causal=True)
    return (
        case(name="causal", v_head_dim=head_dim, why="causal"),
        case(name="full", v_head_dim=head_dim, causal=False, why="no mask"),
        case(name="gqa_causal", heads=2 * heads, v_head_dim=head_dim, why=_GQA_WHY),
        case(name="dv_differs", v_head_dim=head_dim // 2, why=_DV_WHY),
    )


QUICK_ATTENTION_CASES = _attention_cases(seq=128, heads=2, head_dim=64)
DEFAULT_ATTENTION_CASES = (
    *_attention_cases(seq=256, heads=4, head_dim=128),
    AttentionCase(
        name="gqa_dv_differs", seq=192, heads=4, kv_heads=2, head_dim=64, v_head_dim=32, causal=True, why=_GQA_DV_WHY
    ),
)


# --- running the matrix --------------------------------------------------------------------


@dataclass
class Check:
    quantity: str
    against: str
    """"fp32", or the backend running the same recipe definition."""
    sqnr_db: float
    threshold_db: float

    @property
    def passed(self) -> bool:
        return self.sqnr_db >= self.threshold_db

    def to_json(self) -> dict:
        return {
            "quantity": self.quantity,
            "against": self.against,
            "sqnr_db": db_value(self.sqnr_db),
            "threshold_db": self.threshold_db,
            "passed": self.passed,
        }


@dataclass
class Row:
    """One (op, recipe, case, backend) cell of the matrix."""

    op: str
    recipe: str
    case: str
    shape: str
    device: str
    backend: str
    routed: bool
    definition: str | None = None
    status: str = "skipped"
    reason: str = ""
    checks: list[Check] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    differs_from: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.backend} ({self.definition})"

    def to_json(self) -> dict:
        return ParityRow(
            op=self.op,
            case=self.case,
            shape=self.shape,
            backend=self.backend,
            recipe=self.recipe,
            definition=self.definition,
            status=self.status,
            reason=self.reason,
            device=self.device,
            routed=self.routed,
            checks=[c.to_json() for c in self.checks],
            problems=self.problems,
            differs_from=self.differs_from,
        ).to_json()


@dataclass
class _Run:
    row: Row
    recipe: Fp8Recipe
    outputs: tuple


def _host_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _case_profile(case, profile: DeviceProfile) -> tuple[DeviceProfile, str]:
    """The profile ``case`` runs under, and why only the emulation runs it ("" when all may)."""
    if not case.fnuz or profile.fnuz:
        return profile, ""
    return device_profile(FNUZ_PROFILE), (
        f"fnuz-range case on a non-FNUZ device ({profile.arch}): it runs under the {FNUZ_PROFILE} profile "
        f"with the emulation only; real kernels run it on {FNUZ_PROFILE} hardware"
    )


def _why_not(backend, case, recipe: str, profile: DeviceProfile, emulation_only: str) -> str:
    if emulation_only and not backend.reference:
        return emulation_only
    return why_not(backend, case.op, recipe, profile, k=case.k, n=case.n)


def _routed(case, recipe: str, profile: DeviceProfile) -> str | None:
    try:
        return select_backend(case.op, recipe, profile, k=case.k, n=case.n).backend_name
    except BackendUnavailableError:
        return None


def _execute(row: Row, profile: DeviceProfile, compute):
    """``compute()``'s outputs, or None with the row marked: an error, or skipped where a named
    profile's backend cannot run on this host."""
    try:
        return compute()
    except Exception as e:  # a report of what broke, for any backend, beats a traceback
        message = describe_error(e)
        if profile.detected or row.backend == oracle():
            row.status, row.reason = "error", message
        else:
            row.reason = (
                f"could not run on this {_host_device().type} host under the named profile {profile.arch} ({message})"
            )
        return None


def _execute_gemm(row: Row, case, inputs, recipe: Fp8Recipe, profile: DeviceProfile) -> _Run | None:
    row.definition = recipe.definition
    outputs = _execute(row, profile, lambda: case.run(inputs, recipe, row.backend, profile))
    return None if outputs is None else _Run(row, recipe, outputs)


def _decide(row: Row) -> None:
    """Pass or fail, from the row's checks and problems."""
    failed = [
        f"{c.quantity} vs {c.against} {format_db(c.sqnr_db)} dB < {c.threshold_db:g}"
        for c in row.checks
        if not c.passed
    ]
    row.status = "fail" if failed or row.problems else "pass"
    row.reason = "; ".join(row.problems + failed)


def _same_definition_checks(reference: Row, reference_outputs, outputs, quantities) -> list[Check]:
    """Checks of ``outputs`` against another run of the same definition (whole-tensor SQNR only:
    no row floor and no bit-exactness asked; the sentinel asks both)."""
    compared = compare_quantities(
        dict(zip(quantities, reference_outputs)), dict(zip(quantities, outputs)), quantities=quantities
    )
    return [Check(c.quantity, reference.backend, c.sqnr_db, SAME_DEFINITION_BAR_DB) for c in compared]


def _judge(runs: list[_Run], reference, case, inputs) -> None:
    """Attach checks to every run, then decide pass or fail."""
    for run in runs:
        measured = sqnrs(reference, run.outputs)
        run.row.checks = [Check(q, "fp32", db, bar) for q, db, bar in zip(QUANTITIES, measured, fp32_bars(run.recipe))]
        run.row.problems = case.problems(inputs, run.outputs)
    for first, second in combinations(runs, 2):  # the oracle comes first, so it is the reference
        if first.recipe.definition == second.recipe.definition:
            second.row.checks += _same_definition_checks(first.row, first.outputs, second.outputs, QUANTITIES)
        else:
            first.row.differs_from.append(second.row.label)
            second.row.differs_from.append(first.row.label)
    for run in runs:
        _decide(run.row)


def _run_cell(case, recipe: str, requested: DeviceProfile) -> list[Row]:
    profile, emulation_only = _case_profile(case, requested)
    inputs = case.inputs(_host_device())
    reference = case.run(inputs, None, "", profile)
    routed = _routed(case, recipe, profile)
    rows: list[Row] = []
    runs: list[_Run] = []

    def new_row(backend: str) -> Row:
        row = Row(case.op, recipe, case.name, case.shape(), profile.arch, backend, routed=backend == routed)
        rows.append(row)
        return row

    registered = registry.backends()
    oracle_backend = registry.reference_backend()
    for backend in sorted(registered.values(), key=lambda b: not b.reference):
        row = new_row(backend.name)
        row.reason = _why_not(backend, case, recipe, profile, emulation_only)
        if not row.reason:
            runs.append(_execute_gemm(row, case, inputs, backend.recipe_for(recipe, profile), profile))
    runs = [r for r in runs if r is not None]
    # A definition no emulated run covered: the emulation runs it too, for a same-definition comparison.
    emulated_definitions = {
        r.recipe.definition for r in runs if oracle_backend and r.row.backend == oracle_backend.name
    }
    if oracle_backend:
        for other in list(runs):
            if other.recipe.definition not in emulated_definitions:
                emulated_definitions.add(other.recipe.definition)
                extra = _execute_gemm(new_row(oracle_backend.name), case, inputs, other.recipe, profile)
                if extra:
                    runs.insert(0, extra)
    _judge(runs, reference, case, inputs)
    return rows


def _run_attention_case(case: AttentionCase, profile: DeviceProfile) -> list[Row]:
    """FP8 attention of ``case`` on each attention backend here, against fp32 SDPA and, for
    Primus-Turbo, against the emulation (the same definition)."""
    inputs = case.inputs(_host_device())
    reference = case.run(inputs, None, profile)
    route = route_attention(case.name, case.site(), device=profile, backend="auto", bf16=False, fp8=True)
    rows, outputs = [], []
    # A reference implementation (the emulation) first: the others are compared with it too.
    for backend in sorted(
        attention_backends(), key=lambda name: registry.get_backend(name).attention().performance_path
    ):
        row = Row(
            case.op,
            ATTENTION_RECIPE,
            case.name,
            case.shape(),
            profile.arch,
            backend,
            route.fp8 and route.backend == backend,
        )
        rows.append(row)
        row.reason = attention_refusal(backend, profile, case.site(), fp8=True)
        if row.reason:
            continue
        row.definition = "primus_turbo"  # the emulation's is Primus-Turbo's
        found = _execute(row, profile, lambda: case.run(inputs, row.backend, profile))
        if found is None:
            continue
        row.checks = [
            Check(q, "fp32", db, FP8_ATTENTION_BAR_DB) for q, db in zip(ATTENTION_QUANTITIES, sqnrs(reference, found))
        ]
        row.problems = case.problems(inputs, found)
        if outputs:  # the emulation ran first: the reference of the same definition
            row.checks += _same_definition_checks(outputs[0][0], outputs[0][1], found, ATTENTION_QUANTITIES)
        outputs.append((row, found))
        _decide(row)
    return rows


def run_matrix(profile: DeviceProfile, cases, recipes=RECIPE_NAMES, progress=None, attention_cases=()) -> list[Row]:
    """Every (case, recipe) cell, then every FP8 attention case; ``progress``
    (:func:`~titan_primus.cli.progress.progress`) is told each cell as it starts."""
    cells = [(case, recipe) for case in cases for recipe in recipes] + [(case, None) for case in attention_cases]
    rows = []
    for case, recipe in cells:
        if progress is not None:
            progress.starting(f"{case.op} {case.name} {recipe or ATTENTION_RECIPE}: {', '.join(registry.backends())}")
        rows += _run_cell(case, recipe, profile) if recipe else _run_attention_case(case, profile)
        if progress is not None:
            progress.finished()
    return rows


def require_problems(rows: list[Row], required: list[str], profile: DeviceProfile) -> list[str]:
    """Why each backend named with --require did not run here (empty when all did)."""
    registered = registry.backends()
    found = []
    for name in required:
        if name not in registered:
            found.append(f"{name} is not a registered backend (registered: {', '.join(registered)})")
        elif not (available := registered[name].availability(profile)):
            found.append(f"{name} is unavailable on {profile.arch}: {available.reason}")
        elif not any(r.backend == name and r.status != "skipped" for r in rows):
            found.append(f"{name} is available but ran no case on {profile.arch}")
    return found


def parity_settings(profile: DeviceProfile, cases, quick: bool, required: list[str], attention_cases) -> dict:
    return {
        "device": profile.arch,
        "quick": quick,
        "recipes": list(RECIPE_NAMES),
        "required": required,
        "cases": [
            {"name": c.name, "op": c.op, "shape": c.shape(), "why": c.why, "device": _case_profile(c, profile)[0].arch}
            for c in cases
        ]
        + [
            {"name": c.name, "op": c.op, "shape": c.shape(), "why": c.why, "device": profile.arch}
            for c in attention_cases
        ],
        "thresholds_db": {
            "vs_fp32_e4m3": E4M3_BAR_DB,
            "vs_fp32_e5m2": E5M2_BAR_DB,
            "vs_fp32_high_precision": HIGH_PRECISION_BAR_DB,
            "fp8_attention_vs_fp32": FP8_ATTENTION_BAR_DB,
            "same_definition": SAME_DEFINITION_BAR_DB,
        },
    }


def differing_definitions(rows: list[Row]) -> list[tuple[str, str, list[str]]]:
    """(recipe, device profile, its definitions) for each recipe the backends of ``rows`` define
    differently on a profile: those rows are compared with fp32 and the emulation of their own
    definition, not with each other."""
    definitions: dict[tuple[str, str], set[str]] = {}
    for r in rows:
        definitions.setdefault((r.recipe, r.device), set()).add(r.definition)
    return [(recipe, device, sorted(found)) for (recipe, device), found in definitions.items() if len(found) > 1]


def parity_document(profile: DeviceProfile, quick: bool, required: list[str], progress=None) -> tuple[dict, list[Row]]:
    """The matrix (the quick case set with ``quick``) run under ``profile``, as its results document
    and its rows; the summary's ``ok`` is false when a case failed or raised or a backend in
    ``required`` did not run. ``progress(total)``, when given, is a context giving the reporter
    :func:`run_matrix` tells each cell."""
    cases = QUICK_CASES if quick else DEFAULT_CASES
    attention_cases = QUICK_ATTENTION_CASES if quick else DEFAULT_ATTENTION_CASES
    started = time.perf_counter()
    with (progress or (lambda total: nullcontext()))(len(cases) * len(RECIPE_NAMES) + len(attention_cases)) as reporter:
        rows = run_matrix(profile, cases, RECIPE_NAMES, reporter, attention_cases)
    seconds = time.perf_counter() - started
    missing = require_problems(rows, required, profile)
    counts = Counter(r.status for r in rows)
    summary = {status: counts[status] for status in ("pass", "fail", "error", "skipped")}
    summary.update(
        required_missing=missing, ok=not (counts["fail"] or counts["error"] or missing), seconds=round(seconds, 2)
    )
    settings = parity_settings(profile, cases, quick, required, attention_cases)
    return document("parity", environment(profile), settings, [r.to_json() for r in rows], summary), rows
