"""TorchTitan 0.2.2's trainer with [titan_primus] enable_fsdp_float8_all_gather under FSDP2
(2 gloo ranks): the same losses as with it off, and checkpoints that resume without it."""

import os
from pathlib import Path

import pytest
from support import fp8_gather_probe
from support.repo_root import TESTS
from tt02_helpers import EXAMPLES, convert, meta_model, parallel_dims, run_trainer

from titan_primus.fsdp_fp8 import Fp8AllGatherWeight
from titan_primus.torchtitan02 import Fp8GroupedExperts, Fp8Linear

FSDP2 = ("--parallelism.data_parallel_shard_degree", "2", "--titan_primus.recipe", "tensorwise")
ON = "--titan_primus.enable_fsdp_float8_all_gather"


@pytest.mark.parametrize(
    "recipe, fsdp, wrapped", [("tensorwise", 2, True), ("tensorwise", 1, False), ("rowwise", 2, False)]
)
def test_converter_wraps_weights_only_where_fsdp_gathers_them_exactly(recipe, fsdp, wrapped):
    model = meta_model("deepseek_v3")
    report = convert(
        model, parallel_dims(world_size=fsdp), recipe=recipe, device="cpu", enable_fsdp_float8_all_gather=True
    ).report
    weights = [m.weight for m in model.modules() if isinstance(m, Fp8Linear)]
    experts = [w for m in model.modules() if isinstance(m, Fp8GroupedExperts) for w in (m.w1, m.w2, m.w3)]
    assert weights and experts
    assert all(isinstance(w.data, Fp8AllGatherWeight) == wrapped for w in weights + experts)
    how = "FSDP2 weight all-gather in FP8" if recipe == "tensorwise" else "FSDP2 weight all-gather in bf16"
    assert f"linears: {how}" in report.summary() and f"grouped experts: {how}" in report.summary()


def test_tied_output_projection_keeps_its_tie_and_bf16_all_gather():
    """qwen3's debug model ties output.weight to tok_embeddings.weight: the converter swaps the
    output projection keeping that one parameter and leaves it out of FP8 all-gather (the
    embedding reads its values); the other linears' weights go in FP8."""
    model = meta_model("qwen3")
    assert model.output.weight is model.tok_embeddings.weight
    report = convert(
        model, parallel_dims(world_size=2), recipe="tensorwise", device="cpu", enable_fsdp_float8_all_gather=True
    ).report
    assert isinstance(model.output, Fp8Linear) and model.output.weight is model.tok_embeddings.weight
    assert not isinstance(model.output.weight.data, Fp8AllGatherWeight)
    others = [m.weight for m in model.modules() if isinstance(m, Fp8Linear) and m is not model.output]
    assert others and all(isinstance(w.data, Fp8AllGatherWeight) for w in others)
    assert "except output, in bf16: its weight is tied to tok_embeddings.weight" in report.summary()


def test_blockwise_weights_gather_fp8_where_shards_are_whole_blocks_and_the_report_names_the_others():
    """TorchTitan 0.2 tells the converter the FSDP degree: a linear whose rows do not split into
    whole 128-row blocks per rank keeps its bf16 all-gather, and the routing report names it
    and why; the experts (sharded by expert) and the other linears go in FP8."""
    model = meta_model("deepseek_v3")
    report = convert(
        model, parallel_dims(world_size=2), recipe="blockwise", device="cpu", enable_fsdp_float8_all_gather=True
    ).report
    summary = report.summary()
    linears = {fqn: m for fqn, m in model.named_modules() if isinstance(m, Fp8Linear)}
    whole_blocks = {fqn: -(-m.weight.shape[0] // 2) % 128 == 0 for fqn, m in linears.items()}
    assert any(whole_blocks.values()) and not all(whole_blocks.values())
    for fqn, m in linears.items():
        assert isinstance(m.weight.data, Fp8AllGatherWeight) == whole_blocks[fqn], fqn
        named = f"except {fqn}, in bf16: its 128x128 block scales need shards of whole 128-row blocks" in summary
        assert named != whole_blocks[fqn], summary
    experts = [w for m in model.modules() if isinstance(m, Fp8GroupedExperts) for w in (m.w1, m.w2, m.w3)]
    assert experts and all(isinstance(w.data, Fp8AllGatherWeight) for w in experts)


@pytest.mark.parametrize("world, wrapped", [(4, True), (2, False)])
def test_expert_weights_under_expert_parallelism_gather_fp8_where_fsdp_shards_them(world, wrapped):
    """EP 2 deals out whole experts; FSDP2 then shards each rank's experts over world / 2 ranks,
    so the expert weights gather FP8 (Primus-Turbo's rowwise: per-expert rows), and where that
    leaves one rank (world 2) FSDP2 does not split them: left unwrapped, nothing to save."""
    model = meta_model("deepseek_v3")
    report = convert(
        model,
        parallel_dims(world_size=world, ep=2),
        recipe="rowwise",
        device="gfx942",
        backend="emulated",
        enable_fsdp_float8_all_gather=True,
    ).report
    experts = [w for m in model.modules() if isinstance(m, Fp8GroupedExperts) for w in (m.w1, m.w2, m.w3)]
    assert experts and all(isinstance(w.data, Fp8AllGatherWeight) == wrapped for w in experts)
    assert "grouped experts: FSDP2 weight all-gather in FP8" in report.summary()
    assert not report.gathered_in_high_precision


@pytest.mark.trainer
@pytest.mark.parametrize("model", ["llama3", pytest.param("deepseek_v3", marks=pytest.mark.oldest)])
def test_fp8_all_gather_matches_it_off(model, tmp_path):
    """Losses printed to 5 decimals are equal (the bitwise check is tests/distributed/test_fsdp_fp8_all_gather.py);
    the amaxes are refreshed by the converter's post_optimizer_hook."""
    toml = EXAMPLES / f"{model}_debug_fp8.toml"
    on, log = run_trainer(toml, tmp_path / "on", 3, *FSDP2, ON, nproc=2)
    off, _ = run_trainer(toml, tmp_path / "off", 3, *FSDP2, nproc=2)
    assert "linears: FSDP2 weight all-gather in FP8 payload + scales: tensorwise" in log
    assert "FSDP2 all-gathers FP8 weights as FP8 payload + scales" in log
    if model == "deepseek_v3":
        assert "grouped experts: FSDP2 weight all-gather in FP8 payload + scales: tensorwise" in log
    assert on == off and sorted(on) == [1, 2, 3], (on, off)


@pytest.mark.trainer
@pytest.mark.oldest
def test_checkpoint_with_fp8_all_gather_resumes_on_one_rank_without_it(tmp_path):
    toml, dump = EXAMPLES / "llama3_debug_fp8.toml", tmp_path / "run"
    ckpt = ("--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.exclude_from_loading", "dataloader")
    first, _ = run_trainer(toml, dump, 2, *FSDP2, ON, *ckpt, nproc=2)
    resumed, log = run_trainer(toml, dump, 3, "--titan_primus.recipe", "tensorwise", *ckpt)
    assert "step-2" in log and "Training starts at step 3" in log
    assert sorted(resumed) == [3] and resumed[3] < first[1]


@pytest.mark.trainer
@pytest.mark.multiprocess
def test_trainer_gathers_expert_weights_in_fp8_under_expert_parallelism(tmp_path):
    """deepseek_v3 debug (8 experts per MoE layer), 4 gloo ranks, FSDP 4 with EP 2 (each rank's 4
    experts sharded over 2 ranks), Primus-Turbo's rowwise emulated, 2 steps, activation
    checkpointing off (stock 0.2.2 with EP and selective AC fails on this CPU stack:
    test_token_dispatch.py): every expert weight gathers FP8 ([4, 256, 256] over 2 ranks; 5 MoE
    layers x 3 weights x forward and backward x 2 steps = 60 per rank, recorded by
    tests/support/fp8_gather_probe.py through gather_probe.py as custom_import), none in high
    precision, and the losses equal the option off's (before 2026-12-06: bf16, with a warning)."""
    args = (
        *("--parallelism.data_parallel_shard_degree", "4", "--parallelism.expert_parallel_degree", "2"),
        *("--activation_checkpoint.mode", "none", "--titan_primus.backend", "emulated"),
        *("--titan_primus.device", "gfx942", "--titan_primus.recipe", "rowwise"),
        *("--experimental.custom_import", "gather_probe"),
    )
    path = os.pathsep.join([str(Path(__file__).parent), str(TESTS), os.environ.get("PYTHONPATH", "")])
    runs = {}
    for on in (True, False):
        probe = tmp_path / f"probe-{on}"
        env = {fp8_gather_probe.VARIABLE: str(probe), "PYTHONPATH": path}
        toml = EXAMPLES / "deepseek_v3_debug_fp8.toml"
        losses, log = run_trainer(toml, tmp_path / str(on), 2, *args, *([ON] if on else []), nproc=4, env=env)
        runs[on] = losses, [fp8_gather_probe.read(f"{probe}.{rank}") for rank in range(4)], log
    # 5 MoE layers x 3 weights x forward and backward x 2 steps
    fp8_gather_probe.assert_expert_weights_gathered_fp8(
        runs, [[4, 256, 256], 2, "fp8"], 60, 4, "deepseek_v3, FSDP 4 with EP 2, rowwise (gfx942)"
    )
