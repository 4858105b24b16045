"""Run by test_fsdp_fp8_all_gather.py under torchrun (gloo, any world size): every way a user's
code writes the weights of a model whose tensorwise FP8 weights FSDP2 all-gathers in FP8, each
followed by a forward that must equal, bit for bit, the forward of a fresh model given the same
values through ``load_state_dict``. Each path starts from a model that has already all-gathered
(and taken an optimizer step), so that a scale kept from before the write would be used.

Then a weight alone in its FSDP2 group, and the debug check (``TITAN_PRIMUS_CHECK_FP8_SCALES=1``): with it on, a run whose amaxes are
made wrong on purpose raises naming the weight, and a correct run raises nothing.

Prints one ``RESULT`` line, each rank's {path: whether the forward after the write equals the
fresh model's} and the largest difference where it does not, the amax all-reduces of one
forward, and what the debug check said.

Usage: fsdp_fp8_write_paths.py BACKEND CHECKPOINT_DIR
"""

import logging
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from support.titan_helpers import build, model_config, print_every_rank, token_ids
from torch.distributed.checkpoint.state_dict import set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_primus.integrations.torchtitan.common.cpu_world import exit_without_teardown
from titan_primus.fsdp_fp8 import Fp8AllGatherWeight
from titan_primus.fsdp_fp8 import sharded as sharded_module
from titan_primus.torchtitan import Float8Converter

logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")
dist.init_process_group("gloo")
backend, checkpoint_dir = sys.argv[1], sys.argv[2]
config = Float8Converter.Config(recipe="tensorwise", backend=backend).build().convert(model_config("llama3"))
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
tokens = token_ids(2, 32, torch.Generator().manual_seed(3))  # the same on every rank


def sharded(on_meta: bool = False, seed: int = 0):
    if on_meta:
        with torch.device("meta"):
            model = config.build()
    else:
        model = build(config, seed=seed)
    for module in model.modules():
        if hasattr(module, "use_fp8_all_gather"):
            module.use_fp8_all_gather()
    for block in model.layers.values():
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    assert sum(isinstance(p._local_tensor, Fp8AllGatherWeight) for p in model.parameters()) > 0
    return model


def full_values(model) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}


def trained(optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2)):
    """A sharded model that has all-gathered its FP8 weights and taken one optimizer step."""
    model = sharded()
    opt = optimizer(model.parameters())
    model(tokens).float().square().mean().backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        model(tokens)  # all-gathers with the scales of the updated weights
    model.reshard()  # the root keeps its parameters unsharded after forward
    return model


_source = build(config, seed=1)
# Larger than the trained weights: a kept scale saturates. By state-dict key and by parameter name.
NEW = {k: v * 4 for k, v in full_values(_source).items()}
NEW_PARAMS = {k: v.detach() * 4 for k, v in _source.named_parameters()}


def write_new_values(model, write) -> None:
    with torch.no_grad():
        for key, value in model.state_dict().items():
            write(key, value)


def local(value, key, new=NEW):
    """``new[key]`` sharded like ``value``."""
    return distribute_tensor(new[key], value.device_mesh, value.placements) if isinstance(value, DTensor) else new[key]


def optimizer_path(make):
    def path():
        return trained(make)

    return path


def load_state_dict():
    model = trained()
    model.load_state_dict({k: local(v, k) for k, v in model.state_dict().items()})
    return model


def set_sharded_state_dict():
    model = trained()
    set_model_state_dict(model, {k: local(v, k) for k, v in model.state_dict().items()})
    return model


def dcp_load_in_place():
    source = sharded(seed=1)
    source.load_state_dict({k: local(v, k) for k, v in source.state_dict().items()})
    dcp.save(source.state_dict(), checkpoint_id=checkpoint_dir)
    model = trained()
    dcp.load(model.state_dict(), checkpoint_id=checkpoint_dir)  # no load_state_dict after it
    return model


def state_dict_copy():
    model = trained()
    write_new_values(model, lambda key, value: value.copy_(local(value, key)))
    return model


def param_data_copy():
    model = trained()
    for name, param in model.named_parameters():
        param.data.copy_(local(param, name, NEW_PARAMS))
    return model


def param_in_place():
    model = trained()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(4)
    return model


def local_tensor_in_place():
    model = trained()
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().mul_(4)  # the shard itself, a plain tensor
    return model


def init_weights():
    model = trained()
    torch.manual_seed(5)
    model.init_states()
    return model


def to_empty_and_init():
    model = sharded(on_meta=True)
    model.to_empty(device="cpu")
    torch.manual_seed(6)
    model.init_states()
    with torch.no_grad():
        model(tokens)
    model.reshard()
    torch.manual_seed(7)  # a second initialisation, after the first all-gather
    model.init_states()
    return model


PATHS = {
    "optimizer_adamw_foreach": optimizer_path(lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True)),
    "optimizer_adamw_fused": optimizer_path(lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True)),
    "optimizer_adam_for_loop": optimizer_path(lambda p: torch.optim.Adam(p, lr=1e-2, foreach=False)),
    "optimizer_sgd_foreach": optimizer_path(lambda p: torch.optim.SGD(p, lr=1.0, momentum=0.9, foreach=True)),
    "load_state_dict": load_state_dict,
    "set_model_state_dict": set_sharded_state_dict,
    "dcp_load_in_place": dcp_load_in_place,
    "state_dict_tensor_copy": state_dict_copy,
    "param_data_copy": param_data_copy,
    "param_in_place_no_grad": param_in_place,
    "local_tensor_in_place": local_tensor_in_place,
    "init_weights": init_weights,
    "to_empty_and_init": to_empty_and_init,
}

results = {}
for name, write in PATHS.items():
    model = write()
    values = full_values(model)
    with torch.no_grad():
        out = model(tokens)
    fresh = sharded(seed=2)
    fresh.load_state_dict(
        {k: distribute_tensor(values[k], v.device_mesh, v.placements) for k, v in fresh.state_dict().items()}
    )
    with torch.no_grad():
        expected = fresh(tokens)
    equal = torch.equal(out, expected) and not out.isnan().any()
    results[name] = {"equal": equal, "max_abs_diff": float((out.float() - expected.float()).abs().max())}
_all_reduce = dist.all_reduce
all_reduces = []
dist.all_reduce = lambda tensor, *args, **kwargs: (
    all_reduces.append(tensor.numel()) or _all_reduce(tensor, *args, **kwargs)
)
model = sharded()
with torch.no_grad():
    model(tokens)
dist.all_reduce = _all_reduce
results["amax_all_reduces_per_forward"] = all_reduces  # the number of weights each one carries


def debug_check(wrong: bool) -> str:
    os.environ[sharded_module.CHECK_SCALES_VARIABLE] = "1"
    model = sharded()
    del os.environ[sharded_module.CHECK_SCALES_VARIABLE]
    reduce = sharded_module._all_reduce_amaxes
    if wrong:  # as a stale scale would be: half the weights' amax
        sharded_module._all_reduce_amaxes = lambda *args: [a / 2 for a in reduce(*args)]
    try:
        with torch.no_grad():
            model(tokens)
        return "nothing raised"
    except RuntimeError as error:
        return str(error)
    finally:
        sharded_module._all_reduce_amaxes = reduce


def solo_weight() -> str:
    """One tensorwise FP8 linear wrapped alone (every input of its group's all-gather FP8): its
    forward and weight gradient equal the same linear gathered in bf16, bit for bit. Before:
    FSDP2 made a float8 buffer, which gloo cannot all-gather ("Invalid scalar type")."""
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(5))
    runs = []
    for fp8 in (False, True):
        linear = build(config, seed=0).layers["0"].feed_forward.w1
        if fp8:
            linear.use_fp8_all_gather()
        fully_shard(linear, mp_policy=mp)
        assert isinstance(linear.weight._local_tensor, Fp8AllGatherWeight) == fp8
        try:
            out = linear(x)
            out.float().square().mean().backward()
        except Exception as error:
            return f"{type(error).__name__}: {error}"
        runs.append((out.detach(), linear.weight.grad.full_tensor()))
    (out_bf16, grad_bf16), (out_fp8, grad_fp8) = runs
    return "equal" if torch.equal(out_bf16, out_fp8) and torch.equal(grad_bf16, grad_fp8) else "different"


results["solo_weight"] = solo_weight()
results["debug_check_on_correct_scales"] = debug_check(wrong=False)
results["debug_check_on_wrong_scales"] = debug_check(wrong=True)
print_every_rank(results)
dist.barrier()
exit_without_teardown(0)
