"""FP8 weight all-gather under FSDP2: each rank quantizes its shard of an FP8 layer's weight and
FSDP2 all-gathers FP8 payload plus scales instead of bf16, through FSDP2's own extension points
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` on the sharded weight's tensor subclass).

Nothing changes numerically: the gathered FP8 weight is bit for bit the cast the backend would
have made of the gathered high-precision weight, because

- the shard is first cast to FSDP's ``param_dtype``, as FSDP2 does before a plain all-gather, so
  the same values are quantized (quantizing the fp32 master directly would round twice
  differently);
- tensorwise: the scale is the amax of the whole weight, reduced from the shards' values at
  each all-gather (one all-reduce per FSDP2 parameter group and all-gather, for all its
  tensorwise weights), so no write to the weights, through any alias, can leave a stale scale;
  rounded to ``param_dtype`` like the values (rounding is monotone, so this is the amax of the
  ``param_dtype`` weight);
- rowwise: a forward scale is per output row (per expert and output row for MoE expert
  weights [E, N, K]), reduced over K, and FSDP2 shards rows, experts or an expert's N, never K,
  so each rank's rows carry their whole scale; the scales travel with the payload where FSDP2
  can gather them (even dim-0 shards), else in an all-gather of their own;
- square blocks (``blockwise``'s 128x128, Primus-Turbo's ``mxfp8`` 32x32): one scale per block
  of the weight (per expert), the same blocks for the forward and for grad_input's transpose;
  gathered where every shard is whole blocks (the last may be partial), else in high precision,
  with a warning;
- a weight is gathered in FP8 only where the backward pass needs nothing but that FP8 copy
  (:func:`fp8_all_gather_plan`), and only on backends that take a pre-quantized weight;
- MoE expert weights are quantized from the bf16 copy TorchTitan's experts cast them to; under
  expert parallelism the wrapped weight stays inside the EP DTensor (``distribute_tensor`` keeps
  the subclass) and FSDP2 gathers each rank's experts, which is all that rank computes with, so
  its rows, blocks and (tensorwise) amax are those of the weight its GEMMs take;
- a weight shared with a module that is not an FP8 GEMM (an output projection tied to the token
  embedding) is gathered in high precision: the other module reads its values (the converters
  keep such weights out of FP8 all-gather; the all-gather checks it again).

State dicts hold the plain high-precision tensor (same names, shapes, dtypes). Torch-only: the
TorchTitan adapters wrap the weights.
"""

from __future__ import annotations

from .gathered import Fp8GatheredWeight
from .hooks import (
    disable_fp8_all_gather,
    enable_fp8_all_gather,
)
from .plan import Fp8AllGatherPlan, fp8_all_gather_plan, quantize_weight
from .sharded import Fp8AllGatherWeight

__all__ = [
    "Fp8AllGatherPlan",
    "Fp8AllGatherWeight",
    "Fp8GatheredWeight",
    "fp8_all_gather_plan",
    "enable_fp8_all_gather",
    "disable_fp8_all_gather",
    "quantize_weight",
]
