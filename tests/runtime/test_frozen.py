"""Frozen parameters (``requires_grad=False``), as fine-tuning freezes them: no gradient, no
optimizer state, no update task and no swap-out of weights that never change, and training equal
to eager training of the same partly frozen model (float64, 2 emulated devices below a third of
the training footprint, pp and dp, device and host updates, U_F != U_B where the search allows).

The frozen set covers whole layers (the embeddings, whose weight is tied to the head, and the
first block), part of a layer (one matrix of the second block) and part of the last layer (the
tied head beside a trainable LayerNorm)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from test_training import CAPACITY_SHARE, MINIBATCH, adam, assert_same_training, relative_error

import harmony
from harmony.scheduler.machine import nominal_machine
from harmony.models import gpt2
from harmony.plan import Plan
from harmony.profiling.sweep import training_footprint
from harmony.runtime.reference import microbatches_of, reference_train
from harmony.scheduler.search import search
from harmony.scheduler.tasks import HOST, Channel, Kind
from harmony.scheduler.modes import generate

FROZEN_LAYERS = ("wte.", "wpe.", "h.0.")
FROZEN_MATRIX = "h.1.attn.c_attn.weight"


def frozen(name: str) -> bool:
    return name.startswith(FROZEN_LAYERS) or name == FROZEN_MATRIX


def build(freeze: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = gpt2.build_model("tiny", dtype="float64")
    for name, p in model.named_parameters():
        if freeze and frozen(name):
            p.requires_grad_(False)
    return model


@functools.lru_cache(maxsize=None)
def compiled(freeze: bool):
    model = build(freeze)
    get_batch = functools.partial(gpt2.get_batch, preset="tiny", dtype="float64")
    graph = harmony.decompose(build(False), get_batch(2, 0)[0])
    capacity = int(CAPACITY_SHARE * training_footprint(graph, get_batch, MINIBATCH))
    plan = harmony.compile(model, gpt2.loss_fn, get_batch, minibatch_size=MINIBATCH, devices=1,
                           device_memory=capacity, build_optimizer=adam, probe=False)
    return model, get_batch, plan


def plan_for(mode: str, update: str | None = None, freeze: bool = True) -> tuple[torch.nn.Module, object, Plan]:
    model, get_batch, base = compiled(freeze)
    machine = nominal_machine("cpu", 2, base.profile.capacity)
    result = search(base.profile, machine, mode, 2, MINIBATCH, capacity=base.options["planned_memory"],
                    same_u=bool(base.options["same_u"]))
    tasks = result.graph
    if update is not None:
        tasks = generate(mode, base.profile, result.graph.config, 2, MINIBATCH, update=update)
    plan = Plan(graph=base.graph, profile=base.profile, tasks=tasks, estimate={},
                options={**base.options, "devices": 2, "mode": mode})
    plan.loss_fn, plan.build_optimizer = gpt2.loss_fn, adam
    plan.promise_memory()
    return model, get_batch, plan


def frozen_layers(plan: Plan) -> set[int]:
    """Layers all of whose parameters are frozen."""
    out = set()
    for spec in plan.graph.layers:
        params = [plan.graph.state[n] for n in spec.state if plan.graph.state[n].kind == "parameter"]
        if params and not any(p.requires_grad for p in params):
            out.add(spec.index)
    return out


@pytest.mark.parametrize("mode, update", [("pp", "device"), ("pp", "host"), ("dp", "host"), ("dp", "device")])
def test_a_partly_frozen_model_trains_as_eager_training_of_it(mode, update):
    model, get_batch, plan = plan_for(mode, update)
    reference = copy.deepcopy(model)
    batches = [get_batch(MINIBATCH, step) for step in range(4)]
    with harmony.Trainer(plan, optimizer=adam, timeout=30) as trainer:
        losses = [trainer.step(x, y) for x, y in batches]
        state, history = trainer.state_dict(), trainer.history
    expected = reference_train(reference, plan.loss_fn, adam, batches, microbatches_of(plan.tasks))
    assert_same_training(losses, expected, state, reference.state_dict(), tolerance=1e-9)
    assert history[-1].bytes_by_channel() == {k: v for k, v in plan.tasks.bytes_by_channel().items() if v}
    for name, p in build(False).named_parameters():  # frozen weights kept their values bit for bit
        if frozen(name):
            assert torch.equal(state[name], p.detach()), name
    assert relative_error(state["h.1.attn.c_proj.weight"], build(False).state_dict()["h.1.attn.c_proj.weight"]) > 1e-6
    for step in history:
        assert max(w.peak for w in step.workers) <= plan.options["device_memory"]


@pytest.mark.parametrize("mode, update", [("pp", "device"), ("pp", "host"), ("dp", "host"), ("dp", "device"),
                                          ("dp-swap", None)])
def test_frozen_packs_get_no_update_no_gradient_and_no_backward_below_the_lowest_trainable_layer(mode, update):
    options = {"update": update} if update else {}
    _, _, plan = plan_for(mode, **options)
    still = frozen_layers(plan)
    assert still == {0, 1}
    for task in plan.tasks.tasks:
        if set(range(task.first, task.last + 1)) <= still:
            assert task.kind != Kind.UPD and not task.jit_update(), str(task)
            assert not [t for t in task.outputs if t.tensor in ("dW", "K")], str(task)
            if mode != "dp-swap":  # no backward below the lowest trainable layer
                assert task.kind == Kind.FWD, str(task)
                assert not [t for t in task.outputs if t.tensor == "Xs"], str(task)
    if mode != "dp-swap":  # a backward pack may start below layer 2 only if it reaches layer 2
        assert min(t.first for t in plan.tasks.tasks if t.kind == Kind.BWD) <= 2
        assert not [t for t in plan.tasks.tasks if t.kind == Kind.BWD and t.last < 2]


def test_freezing_cuts_the_planned_gradient_state_and_weight_bytes_by_the_frozen_sizes():
    """dp with device updates moves, per device and pack, the summed gradient and the state in and
    the stepped weights and state out: each drops by exactly what the frozen parameters hold."""
    model = build(True)
    frozen_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if frozen(n))
    trainable = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not frozen(n))
    plans = {freeze: plan_for("dp", "device", freeze=freeze)[2] for freeze in (False, True)}
    # the same packing for both, so that only the frozen sizes differ
    config = plans[False].tasks.config
    for freeze in (False, True):
        plans[freeze].tasks = generate("dp", plans[freeze].profile, config, 2, MINIBATCH, update="device")

    def moved(plan, tensor, direction):
        return sum(t.nbytes for task in plan.tasks.tasks if task.kind == Kind.UPD
                   for t in getattr(task, direction) if t.tensor == tensor and t.channel == Channel.SWAP)

    upd_devices = {t.device for t in plans[True].tasks.tasks if t.kind == Kind.UPD}
    assert upd_devices == {0, 1} and HOST not in upd_devices
    assert moved(plans[True], "W", "outputs") == 2 * trainable
    assert moved(plans[False], "W", "outputs") == 2 * (trainable + frozen_bytes)
    assert moved(plans[False], "K", "inputs") - moved(plans[True], "K", "inputs") == 2 * 2 * frozen_bytes  # Adam: 2 slots
    assert sum(l.k_bytes for l in plans[True].profile.layers[:2]) == 0
    assert sum(l.dw_bytes for l in plans[True].profile.layers[:2]) == 0


def test_a_checkpoint_holds_optimizer_state_for_the_trainable_parameters_only(tmp_path):
    _, get_batch, plan = plan_for("pp", "device")
    with harmony.Trainer(plan, optimizer=adam, timeout=30) as trainer:
        trainer.step(*get_batch(MINIBATCH, 0))
        path = trainer.save_checkpoint(tmp_path / "f.pt")
    saved = torch.load(path, weights_only=True)
    trainable = {n for n, p in build(True).named_parameters() if p.requires_grad}
    assert set(saved["optimizer"]) == trainable - {"lm_head.weight"}
    assert set(saved["model"]) >= {n for n, _ in build(True).named_parameters()}


def test_a_model_with_every_parameter_frozen_is_refused_before_profiling():
    model = build(False).requires_grad_(False)
    get_batch = functools.partial(gpt2.get_batch, preset="tiny", dtype="float64")
    with pytest.raises(harmony.HarmonyError, match=r"every parameter of the model \(\d+\) is frozen"):
        harmony.compile(model, gpt2.loss_fn, get_batch, minibatch_size=MINIBATCH, devices=2,
                        device_memory="1MiB", probe=False)


def test_freezing_changes_the_model_fingerprint_so_a_plan_of_the_unfrozen_model_is_not_reused():
    inputs = gpt2.get_batch(2, 0, preset="tiny", dtype="float64")[0]
    assert harmony.decompose(build(True), inputs).fingerprint() != harmony.decompose(build(False), inputs).fingerprint()
