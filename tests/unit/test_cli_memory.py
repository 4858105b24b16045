"""``titan-primus bench --memory`` on a CPU, ``report`` on its JSON, and the memory model it prints.

The audit is titan_primus.diagnostics.memory.saved.audit_layer (its properties: test_memory.py); here, what the
command measures, writes and derives. Here, without an MI300-class GPU, Primus-Turbo's rows are
skipped; the audit runs on Primus-Turbo's own code in the real-code tier
(tests/real_turbo/test_checkpointing_and_memory_audit.py)."""

import io
import json
from contextlib import redirect_stdout

import pytest
import torch

import titan_primus as tp
from titan_primus import cli
from titan_primus.diagnostics.memory import audit
from titan_primus.diagnostics.memory.model import ATTENTION_PATHS, BF16, GemmMemory, attention_saved, estimate
from titan_primus.diagnostics.model_shapes import ARCHITECTURES


# The tests that read this audit run on one worker (--dist loadgroup), which makes it once.
shares_quick = pytest.mark.xdist_group("bench_memory_quick")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    path = tmp_path_factory.mktemp("memory") / "memory.json"
    argv = ["bench", "--memory", "--quick", "--recipe", "tensorwise", "--recipe", "rowwise", "--json", str(path)]
    with redirect_stdout(io.StringIO()) as out:
        assert cli.main(argv) == 0
    return path, out.getvalue()


@shares_quick
def test_bench_memory_audits_every_backend_here_and_writes_json(quick):
    path, text = quick
    doc = json.loads(path.read_text())
    assert doc["kind"] == "memory" and doc["settings"]["paths"] == ["eager"]
    ok = {(r["backend"], r["op"], r["recipe"], r["fp8_all_gather"]) for r in doc["results"] if r["status"] == "ok"}
    assert ("emulated", "grouped_mm", "rowwise", False) in ok and ("torchao", "linear", "tensorwise", True) in ok
    for row in doc["results"]:
        assert row["status"] in ("ok", "skipped") and (row["status"] == "ok" or row["reason"])
        if row["status"] == "ok":
            assert row["kept"]["weight_copy"] == 0 and row["kept"]["parameter"] > 0
    assert "weight copies kept for backward: 0 of" in text
    assert "MODEL, not a measurement" in text and "not measured (no GPU here)" in text
    assert doc["gpu_peak"] is None
    assert "Selective activation checkpointing, MODELLED" in text
    policies = {(r["model"], r["policy"]) for r in doc["selective_ac"]}
    assert ("DeepSeek-V3-671B", "FP8, fp8_gemms='alternate'") in policies and len(policies) == 12
    models = {e["model"] for e in doc["estimates"]}
    assert models == {"Llama3-8B", "Llama3-70B", "Llama3-405B", "DeepSeek-V3-671B"}
    # TorchAO has no grouped GEMM on a CPU: its columns leave the MoE model out.
    assert not any(e["model"] == "DeepSeek-V3-671B" and e["column"].startswith("torchao") for e in doc["estimates"])


@shares_quick
def test_bench_memory_models_attention_and_checks_the_emulation_against_its_saved_tensors(quick):
    path, text = quick
    doc = json.loads(path.read_text())
    checked = doc["attention_check"]
    assert checked["equal"] and checked["modelled_tensors"] == checked["measured_tensors"]
    assert checked["measured_bytes"] == checked["modelled_bytes"] > 0
    assert "tensor for tensor equal" in text
    rows = {(r["model"], r["path"]): r for r in doc["attention"]}
    assert {m for m, _ in rows} == set(ARCHITECTURES) and {p for _, p in rows} == set(ATTENTION_PATHS)
    # Llama3-8B at 8192 tokens: q and out 32 heads x 128, k and v 8 heads x 128, bf16; the LSE fp32 per q head.
    torchtitan = rows["Llama3-8B", ATTENTION_PATHS[0]]
    assert torchtitan["per_layer_bytes"] == 2 * 8192 * 128 * (32 + 8 + 8 + 32) + 4 * 32 * 8192
    fp8 = rows["Llama3-8B", ATTENTION_PATHS[2]]
    assert fp8["qkv_bytes"] == 8192 * 128 * (32 + 8 + 8) and fp8["out_bytes"] == 2 * 8192 * 32 * 128
    assert fp8["other_bytes"] == 4 * 32 * 2 * 8192 + 4 * (32 + 8 + 8) * 8192 // 64  # LSE/Delta (B, H, 2S), descales
    assert rows["DeepSeek-V3-671B", ATTENTION_PATHS[2]]["vs_torchtitan"] < fp8["vs_torchtitan"] < 0.75


def test_the_attention_model_tells_the_emulation_from_primus_turbos_fp8_path():
    """The check compares tensor for tensor: the emulation keeps an (B, Hq, S) LSE and heads-first
    FP8 q/k/v, Primus-Turbo's op a (B, Hq, 2S) LSE/Delta buffer and bshd FP8 q/k/v."""
    measured = audit.emulated_attention_saved(tp.detect_device())
    heads, seq = audit.ATTENTION_AUDIT_HEADS, audit.ATTENTION_AUDIT_SEQ

    def modelled(path):
        return sorted((t.shape, t.element_bytes) for t in attention_saved(path, heads, seq, 1))

    assert measured == modelled(ATTENTION_PATHS[3]) and measured != modelled(ATTENTION_PATHS[2])


@shares_quick
def test_report_renders_memory_files_with_a_plot(capsys, quick, tmp_path):
    path, _ = quick
    png = tmp_path / "memory.png"
    assert cli.main(["report", str(path), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "## Memory: bytes a converted layer keeps" in out and "## Memory per rank" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_model_counts_weight_copies_once_per_weight_and_shared_inputs_once():
    """Llama3-70B, 8 ranks, seq 8192: a backend keeping one byte per weight element keeps the
    whole model's FP8 linear weights on every rank (about 65 GiB, issue 17's 'about 70 GB');
    inputs kept by reference are shared by wq/wk/wv and w1/w3, FP8 copies are one per GEMM."""
    arch = ARCHITECTURES["Llama3-70B"]
    copies = GemmMemory(input_bytes=1.0, input_by_reference=False, weight_copy_bytes=1.0)
    bf16 = estimate(arch, 8, 8192, {False: BF16, True: BF16})
    keeps_copies = estimate(arch, 8, 8192, {False: copies, True: copies})
    fp8_linear_weights = sum(arch.weight_numel(g) for g in arch.blocks[0].gemms) * 80 + arch.weight_numel(arch.output)
    assert keeps_copies["weight_copy_bytes"] == fp8_linear_weights
    assert 60 < keeps_copies["weight_copy_bytes"] / 2**30 < 70
    per_layer_bf16 = 2 * 8192 * (8192 + 8192 + 8192 + 28672)  # attention in, attention out, ffn in, ffn hidden
    assert bf16["gemm_activation_bytes"] == 80 * per_layer_bf16 + 2 * 8192 * 8192  # + the output projection's input
    assert bf16["state_bytes"] == 16 * arch.params / 8


def test_bench_memory_flags_parse():
    args = cli.build_parser().parse_args(
        ["bench", "--memory", "--seq-len", "4096", "--local-batch", "2", "--fsdp-ranks", "64"]
    )
    assert args.memory and (args.seq_len, args.local_batch, args.fsdp_ranks) == (4096, 2, 64)


def test_gpu_peak_harness_runs_under_fsdp2_here():
    """The GPU measurement's FSDP2 harness (one rank), run on the CPU: it runs the blocks forward
    and backward under FSDP2 with an FP8 linear; the allocator peak exists only on a GPU (None
    here). The GPU figures themselves have not been measured (no GPU here)."""
    decision = tp.select_backend("linear", "tensorwise", "cpu", "emulated")
    peak = audit.blocks_peak(
        lambda x, w: decision.backend.linear(x, w, None, decision.recipe),
        torch.device("cpu"),
        blocks=2,
        dim=64,
        hidden=128,
        tokens=32,
    )
    assert peak is None
    assert not torch.distributed.is_initialized()


def test_selective_ac_model_keeps_what_each_policy_saves():
    """Llama3-8B at 8192 tokens: TorchTitan's alternation saves wqkv, w1 and w2 of its five GEMMs
    (6144 + 14336 + 4096 outputs per token, bf16), in bf16 and FP8 alike; saving every FP8 GEMM
    keeps wo and w3 too. DeepSeek-V3: the stock policy saves no grouped GEMM, the alternation half."""
    from titan_primus.diagnostics.memory.model import SAC_POLICIES, selective_ac_rows

    kept = {(r["model"], r["policy"]): r["kept_gemm_output_bytes"] for r in selective_ac_rows(8192, 1)}
    stock, save, alternate = (kept["Llama3-8B", p] for p in SAC_POLICIES)
    assert stock == alternate == 32 * 8192 * 2 * (6144 + 14336 + 4096)
    assert save == 32 * 8192 * 2 * (6144 + 4096 + 14336 + 14336 + 4096)
    stock, save, alternate = (kept["DeepSeek-V3-671B", p] for p in SAC_POLICIES)
    assert stock < alternate < save and abs(alternate / save - 0.5) < 0.01
