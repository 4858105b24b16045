"""Run TorchTitan 0.3.0's real trainer (``torchtitan.train.main``) on a CPU; also TorchTitan main
(2026-08-21), the next line's snapshot (``make test-tt-next``).

Usage (from the repository root; arguments are exactly ``torchtitan.train``'s)::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=1 \\
        titan_primus/integrations/torchtitan/v0_3/launch.py --module llama3 --config llama3_debugmodel \\
        --hf_assets_path titan_primus/integrations/torchtitan/common/assets/tokenizer \\
        --dataloader.dataset_path titan_primus/integrations/torchtitan/common/assets/corpus \\
        --training.steps 5 --training.seq_len 256 --training.local_batch_size 2

Other stock debug configs: ``--module deepseek_v3 --config deepseek_v3_debugmodel``,
``--module qwen3 --config qwen3_moe_debug`` (316M params, ~7 s/step). Add
``--checkpoint.enable --checkpoint.interval 2 --dump_folder DIR`` for DCP
checkpoints (a rerun with the same dump folder resumes from the latest
``DIR/checkpoint/step-N``), ``--compile.enable`` for torch.compile (inductor,
needs a C compiler), ``--debug.seed 42`` for a reproducible init.
(The assets come from ``examples/make_assets.py``.)

``python titan_primus/integrations/torchtitan/v0_3/launch.py ...`` also works for one process: the launcher
then sets the torchrun environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) itself. Use ``OMP_NUM_THREADS=1`` on a 2-core machine.

On TorchTitan main (2026-08-21) the training flags are renamed
(``--training.max_context_length``, ``--training.num_tokens_per_microbatch_per_dp_rank``: see
trainer_flags) and the dataset is set in Python (a Grain loader): there the launcher takes
``--dataloader.dataset_path DIR`` itself and points the loader's Hugging Face source at the JSON
lines in DIR.

Only the workarounds TorchTitan 0.3.0 needs on a machine without an accelerator
(and with gloo for several ranks) are applied; the device is forced to CPU even if
one exists. Each is explained where it is made. Apart from the attention swap
(FlexAttention -> causal SDPA) none changes the numerics.
"""

import dataclasses
import importlib.util
import inspect
import os
from pathlib import Path

from titan_primus.integrations.torchtitan.common import (
    cpu_world,
)  # (0) offline Hugging Face, (1) a single-process world without torchrun

# (2) the CPU device, (4) FSDP2's gradient reduction on gloo, (6) no wait after the last step:
#     patches of TorchTitan, in seams.py; the device must be chosen before anything else from
#     torchtitan is imported.
from titan_primus.integrations.torchtitan.v0_3 import seams  # noqa: E402

seams.use_cpu_device(cpu_world.CPU_DEVICE_MODULE)
seams.reduce_gradients_with_sum(cpu_world.with_sum_reduction)
seams.skip_end_of_training_wait(cpu_world.without_sleep)

from torchtitan.config.configs import TrainingConfig  # noqa: E402
from torchtitan.config.override import derive  # noqa: E402
from torchtitan.models.common.attention import (  # noqa: E402
    FlexAttention,
    ScaledDotProductAttention,
)

# What differs between TorchTitan 0.3.0 and TorchTitan main (2026-08-21):
# - tokens are 1-D (PR #4121): models take [T] token ids, attention gets q/k/v as [T, N, H];
TOKENS_1D = "q_TNH" in inspect.signature(FlexAttention.forward).parameters
# - a microbatch is a token budget: --training.max_context_length and
#   --training.num_tokens_per_microbatch_per_dp_rank replace --training.seq_len and
#   --training.local_batch_size;
TOKEN_BUDGET = "max_context_length" in {f.name for f in dataclasses.fields(TrainingConfig)}
# - the dataloader is Grain's, its dataset set in Python: --dataloader.dataset_path is gone.
GRAIN_LOADER = importlib.util.find_spec("torchtitan.components.data") is not None
DATASET_FLAG = "--dataloader.dataset_path"


def trainer_flags(seq_len: int, batch: int, dataset) -> list[str]:
    """Flags for ``batch`` sequences of ``seq_len`` tokens per rank and step, from the JSON lines in
    the folder ``dataset``, in the installed TorchTitan's names (the launcher takes the dataset
    flag itself where TorchTitan has none)."""
    if TOKEN_BUDGET:
        size = ["--training.max_context_length", str(seq_len)]
        size += ["--training.num_tokens_per_microbatch_per_dp_rank", str(seq_len * batch)]
    else:
        size = ["--training.seq_len", str(seq_len), "--training.local_batch_size", str(batch)]
    return [DATASET_FLAG, str(dataset), *size]


# (3) FlexAttention has no CPU backward (torch 2.14), and every language-model
#     config in 0.3.0 uses it (get_attention_config("flex")). Swap each
#     FlexAttention node for ScaledDotProductAttention(is_causal=True) in the
#     parsed config tree; derive() keeps every shared field (sharding included).
#     The trainer then builds no BlockMask (post_dataloading_process only does
#     for Flex/Varlen). This is done on the tree rather than as an
#     --override.imports entry so that it never conflicts with a user's override
#     of an enclosing node (TorchTitan refuses nested overrides).
#     NUMERICS CHANGE: plain causal attention over the packed sequence, so
#     tokens can attend across document boundaries (document masking is lost).
def flex_to_causal_sdpa(cfg: FlexAttention.Config) -> ScaledDotProductAttention.Config:
    return derive(cfg, TokenMajorCausalSDPA.Config if TOKENS_1D else ScaledDotProductAttention.Config)


class TokenMajorCausalSDPA(ScaledDotProductAttention):
    """Causal SDPA on TorchTitan main's 1-D tokens: q/k/v come as [T, N, H], and SDPA takes
    (B, L, N, H), so a batch of one is added and removed (given [T, N, H] as is, SDPA reads T as
    the batch: a crash on qwen3 and deepseek_v3, and on llama3 each token attending only itself).
    The q/k/v names are the ones TorchTitan main's attention modules have."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        pass

    def forward(self, q_TNH, k_TNH, v_TNH, **kwargs):
        return super().forward(q_TNH.unsqueeze(0), k_TNH.unsqueeze(0), v_TNH.unsqueeze(0), **kwargs).squeeze(0)


class FlexMaskSDPA(FlexAttention):
    """FlexAttention's masks, computed by SDPA on a CPU: the model still builds TorchTitan's
    BlockMask (this is a FlexAttention config), and its ``mask_mod`` is evaluated token by token
    into SDPA's boolean mask. Chosen with ``TITAN_PRIMUS_CPU_ATTENTION=flex-masks`` (the reference
    of the attention route's tests: TorchTitan's own masks, document masking kept); quadratic in
    memory, for debug models."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(FlexAttention.Config):
        pass

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, scale=None, enable_gqa=False, **kwargs):
        import torch
        from torch.nn.attention.flex_attention import create_mask

        B, L = q_BLNH.shape[:2]
        allowed = create_mask(attention_masks.mask_mod, B, None, L, k_BLNH.shape[1], device=q_BLNH.device)
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=scale, enable_gqa=enable_gqa or q.shape[1] != k.shape[1]
        )
        return out.transpose(1, 2)


CPU_ATTENTION = os.environ.get("TITAN_PRIMUS_CPU_ATTENTION", "causal")
"""What replaces FlexAttention here: "causal" (SDPA, document masking lost: the default) or
"flex-masks" (:class:`FlexMaskSDPA`, TorchTitan's own masks)."""


def use_causal_sdpa(model_config) -> None:
    if CPU_ATTENTION not in ("causal", "flex-masks"):
        raise SystemExit(f"[cpu_launch] TITAN_PRIMUS_CPU_ATTENTION={CPU_ATTENTION!r}: choose causal or flex-masks")
    for fqn, attention, parent, attr in list(model_config.traverse(FlexAttention.Config)):
        if CPU_ATTENTION == "flex-masks":
            new, what = derive(attention, FlexMaskSDPA.Config), "SDPA on TorchTitan's FlexAttention masks"
        else:
            new, what = flex_to_causal_sdpa(attention), "causal SDPA (no FlexAttention backward on CPU)"
        if isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
        print(f"[cpu_launch] {fqn}: FlexAttention -> {what}")


def use_local_corpus(dataloader_config, folder: str) -> None:
    """TorchTitan main's Grain loader: every Hugging Face source in the dataloader's dataset graph
    reads the JSON lines in ``folder`` instead (the debug configs' c4_test reads a path relative to
    TorchTitan's own checkout). The graph is frozen dataclasses: rebuilt with the new source."""
    from torchtitan.components.data.sources import HuggingFaceRandomAccessSource, HuggingFaceStreamingSource

    files = sorted(str(p) for p in Path(folder).glob("*.jsonl"))
    if not files:
        raise SystemExit(f"[cpu_launch] {DATASET_FLAG} {folder}: no *.jsonl file there")
    local = HuggingFaceRandomAccessSource.Config(path="json", split="train", load_dataset_kwargs={"data_files": files})
    sources = (HuggingFaceRandomAccessSource.Config, HuggingFaceStreamingSource.Config)
    replaced = []

    def with_local_source(node, where):
        if isinstance(node, sources):
            replaced.append(where)
            return local
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            changes = {}
            for f in dataclasses.fields(node):
                value = getattr(node, f.name)
                new = with_local_source(value, f"{where}.{f.name}")
                if new is not value:
                    changes[f.name] = new
            return dataclasses.replace(node, **changes) if changes else node
        if isinstance(node, (list, tuple)):
            new = [with_local_source(v, f"{where}.{i}") for i, v in enumerate(node)]
            return type(node)(new) if any(n is not v for n, v in zip(new, node)) else node
        return node

    dataloader_config.dataset = with_local_source(dataloader_config.dataset, "dataloader.dataset")
    if not replaced:
        raise SystemExit(f"[cpu_launch] {DATASET_FLAG}: the dataloader's dataset reads no Hugging Face source")
    print(f"[cpu_launch] {', '.join(replaced)}: reads {folder}")


def _take_dataset_flag(args: list[str]) -> tuple[list[str], str | None]:
    """(args without ``--dataloader.dataset_path DIR``, DIR or None)."""
    for i, arg in enumerate(args):
        if arg == DATASET_FLAG and i + 1 < len(args):
            return args[:i] + args[i + 2 :], args[i + 1]
        if arg.startswith(DATASET_FLAG + "="):
            return args[:i] + args[i + 1 :], arg.split("=", 1)[1]
    return args, None


def cpu_config(parse, args: list[str]):
    """The parsed config, edited for a CPU (seams.edit_parsed_config)."""
    corpus = None
    if GRAIN_LOADER:
        args, corpus = _take_dataset_flag(args)
    config = parse(args)
    use_causal_sdpa(config.model_spec.model)
    if corpus is not None:
        use_local_corpus(config.dataloader, corpus)
    # (5) Expert parallelism: the default spmd_types backend's all-to-all gives the ranks
    #     mismatched split sizes on gloo ("ProcessGroupGloo::alltoall: invalid tensor size"),
    #     with or without titan-primus; the DTensor backend's all-to-all works.
    if config.parallelism.expert_parallel_degree > 1 and config.parallelism.spmd_backend == "spmd_types":
        config.parallelism.spmd_backend = "partial_dtensor"
        print("[cpu_launch] expert parallelism on gloo: parallelism.spmd_backend = partial_dtensor")
    return config


seams.edit_parsed_config(cpu_config)


if __name__ == "__main__":
    from torchtitan.train import main

    cpu_world.exit_without_teardown(main())
