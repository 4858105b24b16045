"""How closely a converted model on Primus-Turbo's own code agrees with the same model on the
emulation: measured against the emulation's agreement with itself after a last-bit change."""

import titan_primus as tp

__all__ = ["MARGIN_DB", "PERTURBATION", "agreement", "step"]

# The emulation against itself with the embeddings changed in their last bits: how far FP8
# rounding carries a last-bit difference through the model. Primus-Turbo's kernels and the
# emulation differ by that much (accumulation order, single elements one bf16 ulp apart); a
# real defect (a wrong scale, layout or operand) costs far more than MARGIN_DB.
PERTURBATION = 1e-6
MARGIN_DB = 6.0


def step(model, tokens):
    """One forward and backward of ``model``: (logits, {parameter name: gradient})."""
    out = model(tokens)
    out.float().pow(2).mean().backward()
    return out.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def agreement(a, b) -> tuple[float, float]:
    """(SQNR of the logits, worst SQNR over the parameter gradients) of ``b`` against ``a``."""
    return tp.sqnr(a[0], b[0]), min(tp.sqnr(a[1][name], b[1][name]) for name in a[1])
