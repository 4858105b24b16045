"""What ``titan-primus bench`` measures: forward+backward throughput of the FP8 ops against bf16.

Each available backend runs each recipe on model-shaped GEMMs, next to the bf16 op they replace
(``F.linear``, ``torch._grouped_mm``). Reported: ms per forward+backward, TFLOP/s (3 GEMMs of
2*M*K*N FLOPs), the speed-up over bf16, and the fraction of the device's dense datasheet peak
(FP8 peak for FP8 backends, BF16 peak for bf16).

Shapes (M rows x K in -> N out):
- Linears of Llama3-8B (dim 4096, 8 KV heads x 128 = 1024, FFN 14336) and Llama3-70B (dim 8192,
  KV 1024, FFN 28672), from TorchTitan 0.3.0 ``models/llama3/__init__.py`` (``_8b``, ``_70b``),
  M = 8192 tokens (one 8192-token sequence, as in TorchAO's published Llama3-8B FP8 runs).
- Expert GEMMs of DeepSeek-V3-671B (dim 7168, expert FFN 2048, 256 experts, top-8) and
  Qwen3-235B-A22B (dim 4096, expert FFN 1536, 128 experts, top-8), from TorchTitan 0.3.0
  ``models/deepseek_v3`` (``_671b``) and ``models/qwen3`` (``_235b_a22b``): 8 local experts per
  rank (expert parallelism 32 and 16), 8192 tokens x top-8 = 65536 rows, balanced.
- Attention of Llama3-8B (32 query heads, 8 KV heads, head dim 128) and DeepSeek-V3-671B (MLA: 128
  heads, q/k head dim 192, v head dim 128), causal, one 8192-token sequence: torch's SDPA in bf16
  (the baseline), Primus-Turbo's bf16 flash attention (AITER's varlen kernels) and its FP8 attention
  (``flash_attn_fp8_func``, blockwise 64), through the converter's own call (``attend``). FLOPs,
  FlashAttention's convention: forward 2*B*H*Sq*Sk*(D + Dv) (4*B*H*Sq*Sk*D where D == Dv),
  halved for causal; backward 2.5x forward. The emulated FP8 attention is an exact reference,
  not a performance path: timed on a CPU only (so the code path runs), skipped on a GPU.
On a CPU every GEMM dimension is divided by 16 (attention: the sequence and the heads, keeping the
head dims and the query heads per KV head), and the figures are not FP8 performance.

Timing: on CUDA/ROCm, device events around ``iters`` steps after ``warmup`` untimed ones; on a
CPU, wall-clock time. Eager by default; ``compile`` wraps each forward in ``torch.compile`` (as
TorchTitan compiles its blocks: TorchAO's casts are fused only then), the warm-up absorbing the
compilation.
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .. import registry
from ..attention import AttentionSite, attend, attention_backends, attention_refusal, backend_route
from ..device import DeviceProfile, detect_device
from ..numerics import sdpa
from ..recipes import with_token_groups_padded_to
from ..routing import RoutingDecision, select_backend
from .environment import ATTENTION_RECIPE, describe_error, environment, why_not
from .model_shapes import ARCHITECTURES, AttentionHeads
from .records import BenchRow
from .results import document
from .sentinel_cost import sentinel_cost
from .traffic.ep import ep_traffic_rows
from .traffic.fsdp import traffic_rows

__all__ = [
    "ATTENTION_FLOPS",
    "ATTENTION_SHAPES",
    "CPU_DIVISOR",
    "DATASHEET_PEAKS",
    "GROUPED_SHAPES",
    "LINEAR_SHAPES",
    "QUICK_CPU_DIVISOR",
    "AttentionShape",
    "BenchShape",
    "Peak",
    "bench_document",
    "cpu_note",
    "peak_for",
    "run_attention_bench",
    "run_bench",
    "gemm_step",
    "time_ms",
]


@dataclass(frozen=True)
class BenchShape:
    op: str
    name: str
    m: int
    """Rows: tokens for a linear, all experts' rows for a grouped GEMM."""
    k: int
    n: int
    groups: int = 1

    @property
    def flops(self) -> int:
        return 6 * self.m * self.k * self.n

    def scaled(self, divisor: int) -> BenchShape:
        return replace(self, m=self.m // divisor, k=self.k // divisor, n=self.n // divisor)

    def describe(self) -> str:
        experts = f" E={self.groups}" if self.op == "grouped_mm" else ""
        return f"M={self.m} K={self.k} N={self.n}{experts}"


@dataclass(frozen=True)
class AttentionShape:
    name: str
    heads: AttentionHeads
    seq: int
    batch: int = 1
    causal: bool = True
    op = "attention"

    @property
    def forward_flops(self) -> int:
        """S = QK^T and O = PV: 2*B*H*Sq*Sk*(D + Dv), halved for causal."""
        h = self.heads
        full = 2 * self.batch * h.heads * self.seq * self.seq * (h.head_dim + h.v_head_dim)
        return full // 2 if self.causal else full

    @property
    def flops(self) -> int:
        """Forward + backward, the backward 2.5x the forward."""
        return self.forward_flops * 7 // 2

    def scaled(self, divisor: int) -> AttentionShape:
        """The sequence (a multiple of 64, FP8 attention's blocks) and the heads divided, the head dims
        and the query heads per KV head kept."""
        h = self.heads
        group = h.heads // h.kv_heads
        heads = max(h.heads // divisor, group)
        seq = max(64, self.seq // divisor // 64 * 64)
        return replace(self, heads=replace(h, heads=heads, kv_heads=heads // group), seq=seq)

    def site(self) -> AttentionSite:
        return AttentionSite(causal=self.causal, head_dims=(self.heads.head_dim, self.heads.v_head_dim))

    def describe(self) -> str:
        h = self.heads
        mask = "causal" if self.causal else "full"
        return f"B={self.batch} S={self.seq} Hq={h.heads} Hkv={h.kv_heads} D={h.head_dim} Dv={h.v_head_dim} {mask}"


_TOKENS = 8192
_ROUTED_ROWS = _TOKENS * 8  # top-8 routing, balanced over a rank's local experts


def _llama3(name: str, dim: int, kv: int, ffn: int) -> list[BenchShape]:
    return [
        BenchShape("linear", f"{name}.wq_wo", _TOKENS, dim, dim),
        BenchShape("linear", f"{name}.wk_wv", _TOKENS, dim, kv),
        BenchShape("linear", f"{name}.w1_w3", _TOKENS, dim, ffn),
        BenchShape("linear", f"{name}.w2", _TOKENS, ffn, dim),
    ]


def _experts(name: str, dim: int, hidden: int) -> list[BenchShape]:
    return [
        BenchShape("grouped_mm", f"{name}.w1_w3", _ROUTED_ROWS, dim, hidden, groups=8),
        BenchShape("grouped_mm", f"{name}.w2", _ROUTED_ROWS, hidden, dim, groups=8),
    ]


LINEAR_SHAPES = (*_llama3("llama3_8b", 4096, 1024, 14336), *_llama3("llama3_70b", 8192, 1024, 28672))
GROUPED_SHAPES = (*_experts("deepseek_v3", 7168, 2048), *_experts("qwen3_235b", 4096, 1536))
ATTENTION_SHAPES = (
    AttentionShape("llama3_8b.attention", ARCHITECTURES["Llama3-8B"].attention, _TOKENS),
    AttentionShape("deepseek_v3.attention", ARCHITECTURES["DeepSeek-V3-671B"].attention, _TOKENS),
)
ATTENTION_FLOPS = (
    "attention FLOPs (FlashAttention's convention): forward 2*B*H*Sq*Sk*(D+Dv) (4*B*H*Sq*Sk*D for D = Dv), "
    "halved for causal; backward 2.5x forward"
)


def attention_paths() -> list[tuple[str, str, bool]]:
    """(backend, recipe, FP8?) of each attention measurement besides the bf16 SDPA baseline: each
    backend with attention kernels, its bf16 path then its FP8 one; performance paths first, a
    reference implementation (the emulation) after."""
    paths = []
    for name in sorted(attention_backends(), key=lambda n: not registry.get_backend(n).attention().performance_path):
        kernels = registry.get_backend(name).attention()
        paths += [(name, "bf16", False)] if kernels.bf16 else []
        paths += [(name, ATTENTION_RECIPE, True)] if kernels.fp8 else []
    return paths


_EMULATION_ON_GPU = (
    "not a performance path: the emulated FP8 attention is an exact reference of Primus-Turbo's (float64 dot "
    "products, a Python loop over 64-token blocks); timed on a CPU only, so the code path runs"
)
CPU_DIVISOR = 16
QUICK_CPU_DIVISOR = 64


@dataclass(frozen=True)
class Peak:
    fp8: float
    bf16: float


# Dense (no 2:4 sparsity) peak TFLOP/s of one GPU; vendors' headline figures with sparsity are 2x.
# - MI300X: AMD Instinct MI300X data sheet, FP8 2614.9, BF16 1307.4 (also shared/reference/primus-turbo.md).
# - MI325X: the same CDNA 3 compute as MI300X; AMD's MI325X specifications list FP8 2614.9, BF16 1307.4.
# - MI355X: AMD Instinct MI355X specifications, OCP-FP8 ~5.0 PFLOPS, BF16 ~2.5 PFLOPS (AMD at ISSCC 2026:
#   "five petaflops" FP8; The Register, 2025-06-12).
# - H100 and H200 (SXM): NVIDIA H100 / H200 data sheets, FP8 3958 and BF16 1979 with sparsity (same GH100 compute).
# - B200 (HGX, 1000 W): NVIDIA Blackwell data sheet, FP8 9 and BF16 4.5 PFLOPS with sparsity.
DATASHEET_PEAKS = {
    "MI300X": Peak(fp8=2614.9, bf16=1307.4),
    "MI325X": Peak(fp8=2614.9, bf16=1307.4),
    "MI355X": Peak(fp8=5000.0, bf16=2500.0),
    "H100": Peak(fp8=1978.9, bf16=989.4),
    "H200": Peak(fp8=1978.9, bf16=989.4),
    "B200": Peak(fp8=4500.0, bf16=2250.0),
}


def cpu_note(divisor: int) -> str:
    return (
        "CPU figures are not FP8 performance: a CPU has no FP8 matrix units, the emulated backend runs fp32 "
        "matmuls around FP8 quantization, and TorchAO's CPU _scaled_mm is a reference kernel. Shapes are the "
        f"model shapes divided by {divisor} (attention: its sequence and heads; the emulated FP8 attention is an "
        "exact reference, timed here only so its code path runs). Run on an MI300-class or SM89+ GPU for FP8 "
        "throughput."
    )


def peak_for(device_name: str) -> tuple[str, Peak] | None:
    """The datasheet entry whose key appears in the device's marketing name, if any."""
    upper = device_name.upper()
    return next(((key, peak) for key, peak in DATASHEET_PEAKS.items() if key in upper), None)


def time_ms(step, warmup: int, iters: int, on_gpu: bool) -> float:
    for _ in range(warmup):
        step()
    if not on_gpu:
        started = time.perf_counter()
        for _ in range(iters):
            step()
        return (time.perf_counter() - started) * 1000 / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _gemm_inputs(shape: BenchShape, device: torch.device, generator: torch.Generator | None = None):
    """(a, w, grad, offs): w is [N, K] or [E, N, K] like the models' weights, offs the balanced
    groups' end offsets (unused by a linear)."""
    a = torch.randn(shape.m, shape.k, device=device, generator=generator).bfloat16().requires_grad_()
    w_shape = (shape.n, shape.k) if shape.op == "linear" else (shape.groups, shape.n, shape.k)
    w = (torch.randn(w_shape, device=device, generator=generator) * 0.02).bfloat16().requires_grad_()
    grad = torch.randn(shape.m, shape.n, device=device, generator=generator).bfloat16()
    offs = torch.arange(1, shape.groups + 1, device=device, dtype=torch.int32) * (shape.m // shape.groups)
    return a, w, grad, offs


def gemm_step(shape: BenchShape, device: torch.device, forward):
    """A forward+backward closure of ``forward(a, w, offs)`` (:func:`_gemm_inputs`)."""
    a, w, grad, offs = _gemm_inputs(shape, device)

    def step():
        out = forward(a, w, offs)
        torch.autograd.grad(out, (a, w), grad)

    return step


def _gemm_results(shape: BenchShape, device: torch.device, forward) -> tuple[torch.Tensor, ...]:
    """Output, grad_a and grad_w of one forward+backward on inputs drawn from a fixed seed: the
    same for every path measured on ``shape``, so two paths' results can be compared bit for bit."""
    a, w, grad, offs = _gemm_inputs(shape, device, torch.Generator(device=device).manual_seed(0))
    out = forward(a, w, offs)
    return (out.detach(), *torch.autograd.grad(out, (a, w), grad))


def _attention_step(shape: AttentionShape, device: torch.device, forward):
    """A forward+backward closure of ``forward(q, k, v)`` on bshd bf16 tensors."""
    h, B, S = shape.heads, shape.batch, shape.seq
    dims = ((h.heads, h.head_dim), (h.kv_heads, h.head_dim), (h.kv_heads, h.v_head_dim))
    q, k, v = (torch.randn(B, S, n, d, device=device, dtype=torch.bfloat16, requires_grad=True) for n, d in dims)
    grad = torch.randn(B, S, h.heads, h.v_head_dim, device=device, dtype=torch.bfloat16)

    def step():
        out = forward(q, k, v)
        torch.autograd.grad(out, (q, k, v), grad)

    return step


def _bf16(shape: BenchShape):
    if shape.op == "linear":
        return lambda a, w, offs: F.linear(a, w)
    return lambda a, w, offs: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)


def _fp8(shape: BenchShape, decision: RoutingDecision):
    # Routed once, outside the timed (and compiled) code, as the converter does it.
    impl, recipe = decision.backend, decision.recipe
    if shape.op == "linear":
        return lambda a, w, offs: impl.linear(a, w, None, recipe)
    # The bench's groups are balanced and aligned, as the converters' padding dispatcher delivers them.
    recipe = with_token_groups_padded_to(recipe, impl.group_alignment(recipe))
    return lambda a, w, offs: impl.grouped_mm(a, w.transpose(-2, -1), offs, recipe)


def _measure(
    row: dict,
    shape,
    forward,
    timing: tuple[int, int],
    device: torch.device,
    compile: bool,
    make_step=gemm_step,
    results: bool = False,
) -> tuple[torch.Tensor, ...] | None:
    """Time ``forward`` into ``row``; ``results``: also return :func:`_gemm_results` of the same
    (compiled, where ``compile``) forward."""
    if compile:
        # Every measurement's closure shares one code object: without a reset, dynamo's recompile
        # limit would silently send later measurements back to eager.
        torch._dynamo.reset()
        forward = torch.compile(forward)
    try:
        ms = time_ms(make_step(shape, device, forward), *timing, on_gpu=device.type == "cuda")
        found = _gemm_results(shape, device, forward) if results else None
    except Exception as e:  # one backend breaking must not hide the others' figures
        row.update(status="error", reason=describe_error(e))
        return None
    row.update(status="ok", ms=ms, tflops=shape.flops / ms / 1e9)
    return found


def _compare_with_stock(stock_row: dict, row: dict, results, stock_results) -> None:
    """``stock_row`` (an upstream entry point's, timed) beside ``row`` (the backend that wraps it):
    the time ratio, and whether the two gave the same bits on the same inputs."""
    if stock_row["status"] == "ok":
        stock_row["titan_primus_vs_stock"] = row["ms"] / stock_row["ms"]
        stock_row["bitwise_equal_to_titan_primus"] = all(torch.equal(x, y) for x, y in zip(results, stock_results))


def _against(row: dict, baseline: dict, peak_tflops: float | None) -> None:
    """A measured row's speed-up over the bf16 baseline and fraction of ``peak_tflops``."""
    if row["status"] == "ok" and baseline["status"] == "ok":
        row["speedup_vs_bf16"] = baseline["ms"] / row["ms"]
    if row["status"] == "ok" and peak_tflops:
        row["fraction_of_peak"] = row["tflops"] / peak_tflops


def _row(shape: BenchShape | AttentionShape, backend: str, recipe: str | None) -> dict:
    return {
        "op": shape.op,
        "case": shape.name,
        "shape": shape.describe(),
        "flops": shape.flops,
        "backend": backend,
        "recipe": recipe,
        "definition": None,
        "status": "skipped",
        "reason": "",
        "ms": None,
        "tflops": None,
        "speedup_vs_bf16": None,
        "fraction_of_peak": None,
    }


def _device_and_peak(profile: DeviceProfile):
    """The device the timings run on, and its published peaks (None where unknown)."""
    found = peak_for(profile.name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu"), found[1] if found else None


def run_bench(
    shapes, recipes: list[str], timing: tuple[int, int], profile: DeviceProfile, compile: bool = False, progress=None
) -> list[dict]:
    """One bf16 row and one row per backend and recipe for each shape, and beside a backend's row
    one of the upstream entry point it wraps, where it names one (``stock_path``: stock TorchAO
    beside the TorchAO backend), with the time ratio and whether the two give the same bits;
    ``progress`` (:func:`~titan_primus.cli.progress.progress`) is told each shape as it starts."""
    device, peak = _device_and_peak(profile)
    rows = []
    for shape in shapes:
        if progress is not None:
            progress.starting(f"{shape.op} {shape.name}: bf16, {', '.join(registry.backends())} x {', '.join(recipes)}")
        baseline = _row(shape, "bf16", None)
        _measure(baseline, shape, _bf16(shape), timing, device, compile)
        if peak and baseline["tflops"]:
            baseline["fraction_of_peak"] = baseline["tflops"] / peak.bf16
        rows.append(baseline)
        for backend in registry.backends().values():
            for recipe in recipes:
                row = _row(shape, backend.name, recipe)
                rows.append(row)
                row["reason"] = why_not(backend, shape.op, recipe, profile, k=shape.k, n=shape.n)
                if row["reason"]:
                    continue
                decision = select_backend(shape.op, recipe, profile, backend.name, k=shape.k, n=shape.n)
                row["definition"] = decision.recipe.definition
                stock, _ = backend.stock_path(shape.op, decision.recipe)
                results = _measure(row, shape, _fp8(shape, decision), timing, device, compile, results=bool(stock))
                _against(row, baseline, peak and peak.fp8)
                if stock is None or row["status"] != "ok":
                    continue
                stock_row = _row(shape, f"{backend.name} (stock)", recipe)
                stock_row.update(definition=row["definition"], stock_of=backend.name, stock_path=stock.label)
                rows.append(stock_row)
                stock_results = _measure(stock_row, shape, stock.forward, timing, device, compile, results=True)
                _against(stock_row, baseline, peak and peak.fp8)
                _compare_with_stock(stock_row, row, results, stock_results)
        if progress is not None:
            progress.finished()
    return rows


def run_attention_bench(
    shapes, timing: tuple[int, int], profile: DeviceProfile, compile: bool = False, progress=None
) -> list[dict]:
    """Per attention shape: bf16 SDPA, then each path of :func:`attention_paths` that runs here."""
    device, peak = _device_and_peak(profile)
    paths, rows = attention_paths(), []
    for shape in shapes:
        if progress is not None:
            named = ", ".join(f"{backend} {'FP8' if fp8 else 'bf16'}" for backend, _, fp8 in paths)
            progress.starting(f"attention {shape.name}: bf16 SDPA, {named}")
        baseline = _row(shape, "bf16", None)
        _measure(
            baseline,
            shape,
            lambda q, k, v: sdpa(q, k, v, causal=shape.causal),
            timing,
            device,
            compile,
            _attention_step,
        )
        if peak and baseline["tflops"]:
            baseline["fraction_of_peak"] = baseline["tflops"] / peak.bf16
        rows.append(baseline)
        for backend, recipe, fp8 in paths:
            row = _row(shape, backend, recipe)
            rows.append(row)
            row["reason"] = attention_refusal(backend, profile, shape.site(), fp8=fp8)
            if (
                not row["reason"]
                and not registry.get_backend(backend).attention().performance_path
                and device.type != "cpu"
            ):
                row["reason"] = _EMULATION_ON_GPU
            if row["reason"]:
                continue
            row["definition"] = "primus_turbo" if fp8 else None  # FP8 attention's one definition
            route = backend_route(shape.name, backend, fp8=fp8, device=profile, reason="bench")

            def forward(q, k, v, route=route, causal=shape.causal):
                return attend(route, q, k, v, scale=None, causal=causal)

            _measure(row, shape, forward, timing, device, compile, _attention_step)
            _against(row, baseline, peak and (peak.fp8 if fp8 else peak.bf16))
        if progress is not None:
            progress.finished()
    return rows


def bench_document(
    recipes: list[str],
    quick: bool,
    compile: bool,
    iters: int | None,
    warmup: int | None,
    fsdp_ranks: int,
    progress=None,
) -> dict:
    """Everything ``titan-primus bench`` measures on this machine, as its results document: the
    timed rows, and in its settings the timing, the sentinel's cost (eager: compile refuses the
    sentinel) and the modelled FSDP2 all-gather (``fsdp_ranks`` ranks) and expert-parallel
    all-to-all traffic. ``progress(total)``, when given, is a context giving the reporter
    :func:`run_bench` tells each shape."""
    profile = detect_device()
    on_gpu = profile.kind != "cpu"
    divisor = 1 if on_gpu else QUICK_CPU_DIVISOR if quick else CPU_DIVISOR
    shapes = [
        s.scaled(divisor)
        for s in ((LINEAR_SHAPES[0], GROUPED_SHAPES[0]) if quick else (*LINEAR_SHAPES, *GROUPED_SHAPES))
    ]
    attention_shapes = [s.scaled(divisor) for s in ATTENTION_SHAPES]
    timing = (warmup or (1 if quick or not on_gpu else 5), iters or (1 if quick else 20 if on_gpu else 3))
    started = time.perf_counter()
    with (progress or (lambda total: nullcontext()))(len(shapes) + len(attention_shapes)) as reporter:
        rows = run_bench(shapes, recipes, timing, profile, compile, reporter)
        rows += run_attention_bench(attention_shapes, timing, profile, compile, reporter)
    seconds = time.perf_counter() - started
    found = peak_for(profile.name)
    settings = {
        "recipes": recipes,
        "quick": quick,
        "mode": "torch.compile" if compile else "eager",
        "warmup": timing[0],
        "iters": timing[1],
        "shape_divisor": divisor,
        "peak": {"device": found[0], "fp8_tflops": found[1].fp8, "bf16_tflops": found[1].bf16} if found else None,
        "note": "" if on_gpu else cpu_note(divisor),
        "attention_flops": ATTENTION_FLOPS,
        "fsdp_all_gather_model": traffic_rows(fsdp_ranks),
        "ep_all_to_all_model": ep_traffic_rows(),
        "sentinel_cost": sentinel_cost(shapes, recipes[0], timing, profile, gemm_step, time_ms),
    }
    counts = Counter(r["status"] for r in rows)
    summary = {status: counts[status] for status in ("ok", "error", "skipped")}
    summary["seconds"] = round(seconds, 2)
    return document("bench", environment(profile), settings, [BenchRow.from_fields(r).to_json() for r in rows], summary)
