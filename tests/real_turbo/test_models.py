"""TorchTitan 0.3's MoE debug model converted for an MI300-class profile trains a step on
Primus-Turbo's own code, and agrees with the same model converted to the emulation of
Primus-Turbo's definition as closely as the emulation agrees with itself after a last-bit change."""

import torch
from support.titan_helpers import build, model_config

from real_turbo.conftest import ARCH, one_arch
from real_turbo.model_agreement import MARGIN_DB, PERTURBATION, agreement, step
from titan_primus.torchtitan import Float8Converter


@one_arch
def test_converted_moe_model_trains_a_step_like_the_emulation():
    converter = Float8Converter.Config(device=ARCH, recipe="rowwise").build()
    config = converter.convert(model_config("deepseek_v3"))
    assert {d.backend_name for d in converter.report.decisions.values()} == {"primus_turbo"}, converter.report.summary()
    emulated = (
        Float8Converter.Config(device=ARCH, recipe="rowwise", backend="emulated")
        .build()
        .convert(model_config("deepseek_v3"))
    )
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))

    turbo = step(build(config, seed=0), tokens)
    assert torch.isfinite(turbo[0]).all() and all(torch.isfinite(g).all() for g in turbo[1].values())
    reference = step(build(emulated, seed=0), tokens)
    perturbed_model = build(emulated, seed=0)
    with torch.no_grad():
        embeddings = perturbed_model.tok_embeddings.weight
        embeddings.mul_(1 + PERTURBATION * torch.randn(embeddings.shape, generator=torch.Generator().manual_seed(1)))
    perturbed = step(perturbed_model, tokens)

    baseline = agreement(reference, perturbed)
    measured = agreement(reference, turbo)
    assert turbo[1].keys() == reference[1].keys()
    assert measured[0] >= baseline[0] - MARGIN_DB, (measured, baseline)
    assert measured[1] >= baseline[1] - MARGIN_DB, (measured, baseline)
