"""The numerics sentinel (titan_primus.sentinel) in one process: off by default, changes no bit
when on, checks one layer per checked step in turn, passes on every backend that runs here, and
catches a deliberately corrupted backend (registered through the pluggy registry) on its first
checked step, naming the layer; a breach's capture replays with ``titan-primus parity --replay``.

Primus-Turbo's rows run on its own code: tests/real_turbo/test_failure_classes.py."""

import gc
import json
import weakref
from types import SimpleNamespace

from support import corrupt_backend
import pytest
import torch
from torch._subclasses.fake_tensor import is_fake
from support.sentinel_calls import checked_call, sentinel_inputs
from support.titan_helpers import build, model_config

import titan_primus as tp
from titan_primus import cli, sentinel
from titan_primus.backends.emulated import EmulatedBackend
from titan_primus.conversion import ConversionOptions
from titan_primus.fsdp_fp8 import fp8_all_gather_plan, quantize_weight
from titan_primus.sentinel import FLOOR_DB, SentinelBreach, SentinelOptions, WatchedBackend, capture
from titan_primus.torchtitan import Float8Converter, Fp8Linear

TOKENS = torch.randint(0, 2048, (2, 33), generator=torch.Generator().manual_seed(7))


def converted(model="llama3", **options):
    return build(Float8Converter.Config(device="cpu", **options).build().convert(model_config(model)), seed=0)


def train(model, steps):
    """Losses, per-step gradients and final weights of ``steps`` AdamW steps on one batch."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], []
    for _ in range(steps):
        logits = model(TOKENS[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), TOKENS[:, 1:].flatten())
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads, [p.detach().clone() for p in model.parameters()]


@pytest.fixture
def corrupted():
    """The corrupted test backend, registered as a plugin (rows, from step 1 until a test says otherwise)."""
    tp.registry.register(corrupt_backend, name="corrupt-backend")
    backend = tp.registry.get_backend("corrupted")
    backend.mode, backend.from_step = "rows", 1
    yield backend
    if tp.registry.plugin_manager().is_registered(corrupt_backend):
        tp.registry.unregister(corrupt_backend)


def test_off_by_default_the_modules_call_their_backend_directly():
    assert ConversionOptions().sentinel() is None
    model = converted()
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert fp8 and all(type(m.fp8_backend) is EmulatedBackend for m in fp8)
    assert sentinel.active_sentinel() is None


@pytest.mark.parametrize(
    "options, message",
    [
        ({"sentinel_interval": -1}, "'sentinel_interval' must be a whole number of steps >= 0"),
        ({"sentinel_interval": "10"}, "'sentinel_interval' must be a whole number"),
        (
            {"sentinel_interval": 5, "sentinel_policy": "halt"},
            "'sentinel_policy' must be one of warn, stop, got 'halt'",
        ),
        ({"sentinel_interval": 5, "sentinel_capture_folder": None}, "'sentinel_capture_folder' must be a folder path"),
        ({"sentinel_interval": 5, "model_compile_enabled": True}, "does not run under torch.compile yet"),
    ],
)
def test_bad_sentinel_options_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        Float8Converter.Config(**options).build()


def test_on_it_changes_no_bit_and_checks_one_layer_per_checked_step_in_turn():
    off = train(converted(), 4)
    watched = converted(sentinel_interval=2)
    assert all(isinstance(m.fp8_backend, WatchedBackend) for m in watched.modules() if isinstance(m, Fp8Linear))
    on = train(watched, 4)
    assert all(torch.equal(a, b) for a, b in zip(off[0], on[0]))
    assert all(torch.equal(a, b) for step_a, step_b in zip(off[1], on[1]) for a, b in zip(step_a, step_b))
    assert all(torch.equal(a, b) for a, b in zip(off[2], on[2]))
    active = sentinel.active_sentinel()
    assert [layer.name for layer in active.layers[:2]] == [
        "layers.0.attention.qkv_linear.wqkv",
        "layers.0.attention.wo",
    ]
    reports = active.reports
    assert [(r.step, r.checked_layer) for r in reports] == [
        (2, "layers.0.attention.qkv_linear.wqkv"),
        (4, "layers.0.attention.wo"),
    ]
    for report in reports:
        assert not report.breaches and len(report.checks) == 1
        assert [q.quantity for q in report.checks[0].quantities] == ["out", "grad_input", "grad_weight"]
        assert all(q.bitwise_equal for q in report.checks[0].quantities)  # the emulation checks itself bitwise


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor Python can reach (after a collection)."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        # Fake and functional tensors that an earlier compiled test left behind hold no memory.
        if issubclass(type(obj), torch.Tensor) and obj.device.type != "meta" and not is_fake(obj):
            storage = obj.untyped_storage()
            try:
                storages[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # a functional tensor: its data is its inner tensor's, counted there
                continue
    return sum(storages.values())


def reachable_tensors(root) -> list:
    """Tensors reachable from ``root``'s objects (not through modules, types or functions)."""
    found, seen, todo = [], set(), [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, torch.nn.Module)) or callable(obj):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            continue
        todo.extend(gc.get_referents(obj))
    return found


def test_a_long_run_holds_flat_memory_and_reset_leaves_nothing():
    """60 steps, a check on every one (llama3 debug model, a plain AdamW loop: the real converter
    and sentinel, not the trainer, for speed): live tensor bytes stay what they were after the
    first steps (the optimizer's state), reports keep figures only, and ``reset()`` frees the
    sentinel though the modules keep their watched backends."""
    model = converted(sentinel_interval=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = TOKENS[:, :17]
    live = {}
    for step in range(1, 61):
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
        del logits
        if step in (3, 10, 20, 40, 60):
            live[step] = live_tensor_bytes()
    print("live tensor MiB after steps", {step: round(b / 2**20, 2) for step, b in live.items()})  # -s shows it
    active = sentinel.active_sentinel()
    assert len(active.reports) == 60 and all(len(r.checks) == 1 and r.checks[0].passed for r in active.reports)
    assert live[60] <= live[3] and max(live.values()) == live[3], live  # the old code grew by a layer's call a step
    assert not reachable_tensors(list(active.reports)), "a report keeps figures, never tensors"
    gone = weakref.ref(active)
    del active
    sentinel.reset()
    gc.collect()
    assert gone() is None, "the reset sentinel is still referenced (a watched backend?)"
    model(tokens[:, :-1]).float().mean().backward()  # the modules call their plain backends now
    assert sentinel.active_sentinel() is None


def test_an_expert_block_is_checked_gemm_by_gemm():
    model = converted("deepseek_v3", sentinel_interval=1)
    active = sentinel.active_sentinel()
    index = next(i for i, layer in enumerate(active.layers) if layer.name.endswith("inner_experts"))
    active.begin_step(index + 1)  # a trainer at this step: round robin reaches the expert block
    logits = model(TOKENS[:, :-1])
    logits.float().pow(2).mean().backward()
    report = active.finish_step()
    assert report.checked_layer == active.layers[index].name
    assert [c.record.gemm for c in report.checks] == [1, 2, 3]  # w1, w3, w2
    assert all(c.passed and c.record.op == "grouped_mm" for c in report.checks)
    assert all(q.bitwise_equal for c in report.checks for q in c.quantities)


# (backend, device profile, ops): every backend that runs in this process.
BACKENDS = [
    ("emulated", "cpu", ("linear", "grouped_mm")),
    ("emulated", "gfx942", ("linear", "grouped_mm")),
    ("torchao", "cpu", ("linear",)),  # TorchAO's grouped GEMM has no CPU kernel
]


@pytest.mark.parametrize("backend, device, ops", BACKENDS, ids=lambda v: str(v))
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_every_backend_here_passes_its_check(backend, device, ops, recipe):
    """Bit for bit on the emulation; at least the same-definition floor elsewhere (no false alarm)."""
    impl = tp.registry.get_backend(backend)
    made = impl.recipe_for(recipe, tp.device_profile(device))
    active = sentinel.sentinel_for(SentinelOptions(1))
    generator = torch.Generator().manual_seed(1)
    for op in ops:
        layer = active.register(f"layer.{op}", impl)
        active.begin_step(layer.index + 1)
        report = checked_call(WatchedBackend(active, layer), op, made, sentinel_inputs(op, generator))
        assert report.checked_layer == layer.name and len(report.checks) == 1
        check = report.checks[0]
        assert check.passed, check.problems
        assert [q.quantity for q in check.quantities] == ["out", "grad_input", "grad_weight"]
        if backend == "emulated":
            assert check.bit_exact and all(q.bitwise_equal for q in check.quantities)
        else:
            assert min(q.sqnr_db for q in check.quantities) >= FLOOR_DB


@pytest.mark.parametrize(
    "backend, recipe", [("emulated", "tensorwise"), ("torchao", "tensorwise"), ("emulated", "blockwise")]
)
def test_a_weight_fsdp2_gathered_in_fp8_is_checked_as_the_backend_took_it(backend, recipe):
    """The capture keeps the gathered FP8 payload and scale (ours, or TorchAO's Float8TrainingTensor;
    blockwise: the 128x128 blocks' scale_inv), and a saved capture restores it as it was."""
    impl = tp.registry.get_backend(backend)
    made = impl.recipe_for(recipe, tp.device_profile("cpu"))
    plan, verdict = fp8_all_gather_plan(impl, made)
    assert plan is not None, verdict.reason
    inputs = sentinel_inputs("linear", torch.Generator().manual_seed(2))
    weight = inputs[1]
    data, scale = quantize_weight(weight, plan, weight.abs().amax().float())
    gathered = impl.gathered_weight(data, scale, weight.dtype, made)
    active = sentinel.sentinel_for(SentinelOptions(1))
    layer = active.register("layer", impl)
    active.begin_step(1)
    check = checked_call(WatchedBackend(active, layer), "linear", made, inputs, gathered).checks[0]
    assert check.passed, check.problems
    assert check.bit_exact == (backend == "emulated")
    if backend == "emulated":
        restored = capture._restore(capture._operand(gathered), torch.device("cpu"))
        assert torch.equal(restored.dequantize(), gathered.dequantize()) and restored._block == gathered._block


@pytest.mark.parametrize(
    "mode, from_step, interval, caught_at, layer, expected",
    [
        # wrong rows: only a re-computation sees them, on the first checked step from step 3 (step 4, layer 1)
        ("rows", 3, 2, 4, 1, "out is not bit-identical to the emulation (8 of 64 rows differ: rows 0, 1, 2"),
        ("grad_rows", 2, 3, 3, 0, "grad_input is not bit-identical to the emulation (8 of 64 rows differ"),
        # a NaN: the every-step finite checks name the layer that made it, on the step it appears
        (
            "nan",
            2,
            5,
            2,
            None,
            "non-finite values made by layers.0.attention.qkv_linear.wqkv (call 1, backend corrupted): "
            "out non-finite from finite inputs (max|input| ",
        ),
        # ... and on a checked step the re-computation compares the forward (the gradient came back NaN)
        ("nan", 2, 2, 2, 0, "out has NaN/inf in 1 of 64 rows: rows 0"),
    ],
)
@pytest.mark.parametrize("policy", ["warn", "stop"])
def test_a_corrupted_backend_is_caught_on_the_first_checked_step(
    corrupted,
    mode,
    from_step,
    interval,
    caught_at,
    layer,
    expected,
    policy,
    tmp_path,
):
    corrupted.mode, corrupted.from_step = mode, from_step
    model = converted(
        backend="corrupted", sentinel_interval=interval, sentinel_policy=policy, sentinel_capture_folder=str(tmp_path)
    )
    active = sentinel.active_sentinel()
    if policy == "stop":
        with pytest.raises(SentinelBreach) as raised:
            train(model, caught_at + 1)
        message = str(raised.value)
        assert f"step {caught_at}:" in message and expected in message and "training stopped" in message
        assert active.step == caught_at
    else:
        train(model, caught_at + 1)
    breached = [r for r in active.reports if r.breaches]
    assert breached[0].step == caught_at, [(r.step, r.breaches) for r in active.reports]
    assert expected in breached[0].breaches[0]
    if layer is not None:  # the re-computation named the layer the round robin reached
        assert breached[0].checked_layer == active.layers[layer].name
        assert active.layers[layer].name in breached[0].breaches[0]
        assert all(not r.breaches for r in active.reports if r.step < caught_at)
        (capture,) = tmp_path.glob(f"step{caught_at:07d}-rank0-*.pt")
        assert active.layers[layer].name in capture.name


def test_garbage_past_the_routed_rows_is_named(corrupted, tmp_path):
    corrupted.mode = "trailing"
    active = sentinel.sentinel_for(SentinelOptions(1, capture_folder=str(tmp_path)))
    layer = active.register("layers.1.moe.experts", corrupted)
    active.begin_step(1)
    made = corrupted.recipe_for("rowwise", tp.device_profile("cpu"))
    report = checked_call(
        WatchedBackend(active, layer), "grouped_mm", made, sentinel_inputs("grouped_mm", torch.Generator())
    )
    assert "out is not bit-identical to the emulation (16 of 112 rows differ: rows 96, 97" in report.breaches[0]
    assert "16 of them past offs[-1] = 96, where it must be exactly zero" in report.breaches[0]
    assert [path.name for path in tmp_path.glob("*.pt")] == ["step0000001-rank0-layers.1.moe.experts-gemm1.pt"]
    assert not reachable_tensors(report), "the breached call's tensors went to its file, and only there"


def test_a_capture_replays_on_every_backend_here(corrupted, tmp_path, capsys):
    corrupted.mode = "rows"
    active = sentinel.sentinel_for(SentinelOptions(1, capture_folder=str(tmp_path)))
    layer = active.register("layers.3.feed_forward.w2", corrupted)
    active.begin_step(1)
    made = corrupted.recipe_for("rowwise", tp.device_profile("cpu"))
    checked_call(WatchedBackend(active, layer), "linear", made, sentinel_inputs("linear", torch.Generator()))
    (path,) = tmp_path.glob("*.pt")
    code = cli.main(["parity", "--replay", str(path), "--json", str(tmp_path / "replay.json")])
    out = capsys.readouterr().out
    assert code == 1  # the corrupted backend is registered here too, and replays wrong
    assert "layers.3.feed_forward.w2 (linear; corrupted, rowwise (torchao definition, e4m3fn)), step 1, rank 0" in out
    assert "| captured (corrupted, training machine) |" in out and "reproduced" in out
    assert "corrupted: out is not bit-identical" in out
    doc = json.loads((tmp_path / "replay.json").read_text())
    status = {row["backend"]: row["status"] for row in doc["results"]}
    assert status == {
        "captured (corrupted, training machine)": "reproduced",
        "emulated": "pass",
        "torchao": "pass",
        "corrupted": "fail",
        "primus_turbo": "skipped",
    }
    tp.registry.unregister(corrupt_backend)
    assert cli.main(["parity", "--replay", str(path)]) == 0  # every backend left here agrees with the emulation
    assert cli.main(["parity", "--replay", str(tmp_path / "replay.json")]) == 2  # not a capture: one-line error


class _Recorder:
    def __init__(self):
        self.logged = []

    def log(self, metrics, step):
        self.logged.append((step, metrics))


class _Trainer:
    """The two things of TorchTitan's Trainer the sentinel uses: ``step`` and its metric loggers."""

    compiled = False

    def __init__(self, model, step):
        self.model, self.step = model, step
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.metrics_processor = SimpleNamespace(logger=_Recorder())

    def train_step(self):
        logits = self.model(TOKENS[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), TOKENS[:, 1:].flatten()).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


def test_a_trainer_gives_the_steps_and_receives_the_metrics():
    sentinel.drive_trainer(_Trainer, lambda trainer: trainer.compiled)
    trainer = _Trainer(converted(sentinel_interval=2), step=9)  # resumed from a checkpoint at step 9
    for _ in range(3):
        trainer.step += 1
        trainer.train_step()
    active = sentinel.active_sentinel()
    assert [(r.step, r.checked_layer) for r in active.reports] == [
        (10, active.layers[4].name),
        (12, active.layers[5].name),
    ]
    logged = trainer.metrics_processor.logger.logged
    assert [step for step, _ in logged] == [10, 12]
    assert logged[0][1]["sentinel/breaches"] == 0 and logged[0][1]["sentinel/bitwise_equal"] == 1
    assert logged[0][1]["sentinel/check_ms"] > 0
    trainer.compiled = True
    with pytest.raises(ValueError, match="does not run under torch.compile"):
        trainer.train_step()
