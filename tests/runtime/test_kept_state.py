"""State kept on the devices across iterations (``scheduler/keep.py``) trains as eager does.

Where a device has room for its packs' weights, buffers and optimizer state beside its work, the
plan keeps them there: nothing of it moves, and the device steps it. The host store is then stale
between iterations, so everything that reads or writes it goes through the launcher: ``state_dict``
and checkpoints write the kept state back first (``Launcher.sync``), loading weights or a
checkpoint lets it go (``Launcher.drop``), and closing the trainer writes it back for good.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import harmony
from harmony.scheduler.machine import nominal_machine
from harmony.models import gpt2, resnet
from harmony.plan import Plan
from harmony.profiling.sweep import training_footprint
from harmony.runtime.reference import microbatches_of, reference_train
from harmony.scheduler.keep import keep_state
from harmony.scheduler.memory import kept_on
from harmony.scheduler.modes import generate
from harmony.scheduler.search import boundary_steps, search
from harmony.scheduler.tasks import HOST, Configuration, Kind
from tests.runtime.test_training import adam, assert_same_training

MODELS = {"gpt2": gpt2, "resnet": resnet}  # a tied weight; BatchNorm buffers
MINIBATCH = 8


@functools.lru_cache(maxsize=None)
def compiled(name: str):
    """The model and a one-device plan with room to spare (three training footprints)."""
    torch.manual_seed(0)
    module = MODELS[name]
    model = module.build_model("tiny", dtype="float64")
    get_batch = functools.partial(module.get_batch, preset="tiny", dtype="float64")
    graph = harmony.decompose(model, get_batch(2, 0)[0])
    capacity = 3 * training_footprint(graph, get_batch, MINIBATCH)
    plan = harmony.compile(model, module.loss_fn, get_batch, minibatch_size=MINIBATCH, devices=1,
                           device_memory=capacity, build_optimizer=adam, probe=False)
    return model, get_batch, plan


def plan_for(name: str, mode: str, devices: int, keep: bool = True) -> tuple[torch.nn.Module, object, Plan]:
    """A plan whose updates run on the devices (whether keeping beats stepping on the host is the
    estimate's call, which these tests leave aside)."""
    model, get_batch, base = compiled(name)
    machine = nominal_machine("cpu", devices, base.profile.capacity)
    result = search(base.profile, machine, mode, devices, MINIBATCH, capacity=base.options["planned_memory"],
                    same_u=bool(base.options["same_u"]), keep=keep, update="device")
    plan = Plan(graph=base.graph, profile=base.profile, tasks=result.graph, estimate={},
                options={**base.options, "devices": devices, "mode": mode})
    plan.loss_fn, plan.build_optimizer = MODELS[name].loss_fn, adam
    return model, get_batch, plan


def one_device_plan(base: Plan, tasks, loss_fn) -> Plan:
    """``base``'s plan running ``tasks`` (a one-device pp graph made here), its memory promised."""
    plan = Plan(graph=base.graph, profile=base.profile, tasks=tasks, estimate={},
                options={**base.options, "devices": 1, "mode": "pp"})
    plan.loss_fn, plan.build_optimizer = loss_fn, adam
    plan.promise_memory()
    return plan


def batches(get_batch, steps: int) -> list:
    return [get_batch(MINIBATCH, step) for step in range(steps)]


def trains_as_eager(model: torch.nn.Module, get_batch, plan: Plan, steps: int) -> list:
    """Train ``plan`` for ``steps`` minibatches (memory checked op by op) and hold its losses and
    final weights to eager training on the same microbatches; returns the trainer's history."""
    data = batches(get_batch, steps)
    with harmony.Trainer(plan, optimizer=adam, timeout=20, check_memory=True) as trainer:
        losses = [trainer.step(x, y) for x, y in data]
        state = trainer.state_dict()
        history = trainer.history
    reference = copy.deepcopy(model)
    expected = reference_train(reference, plan.loss_fn, adam, data, microbatches_of(plan.tasks))
    assert_same_training(losses, expected, state, reference.state_dict(), tolerance=1e-9)
    return history


@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_device_with_room_keeps_every_layer_and_trains_as_eager(name):
    model, get_batch, plan = plan_for(name, "pp", 1)
    assert kept_on(plan.tasks) == {0: set(range(len(plan.graph)))}, plan.tasks.to_text()
    history = trains_as_eager(model, get_batch, plan, 4)
    planned = {k: v for k, v in plan.tasks.bytes_by_channel().items() if v}
    assert "SWAP out" not in planned  # no weight, optimizer state or gradient leaves the device
    peak = plan.tasks.memory.devices[0]
    for step in history:  # the first iteration (which loads the kept state) as every later one
        assert step.bytes_by_channel() == planned
        assert step.workers[0].peak <= peak
        assert step.workers[0].ledger_shortfall == 0


@pytest.mark.parametrize("name,mode", [("resnet", "pp"), ("gpt2", "dp")])
def test_two_devices_with_room_train_as_eager_keeping_what_they_step(name, mode):
    """pp: each device keeps the packs only it runs; dp: every device keeps its own replica and
    steps it with the summed gradient, as DistributedDataParallel does."""
    if mode == "pp":  # two packs, one per device (the search may well put everything on one)
        model, get_batch, _ = compiled(name)
        plan = generated(name, [(0, 2), (3, 4)], 2)
    else:
        model, get_batch, plan = plan_for(name, mode, 2)
    on = kept_on(plan.tasks)
    assert set(on) == {0, 1}, plan.tasks.to_text()
    for device, layers in on.items():  # only layers whose every task runs where they are kept
        for layer in layers:
            runs = {t.device for t in plan.tasks.tasks if t.first <= layer <= t.last}
            assert runs == ({device} if mode == "pp" else {0, 1})
    history = trains_as_eager(model, get_batch, plan, 3)
    assert history[-1].bytes_by_channel() == {k: v for k, v in plan.tasks.bytes_by_channel().items() if v}
    assert "SWAP out" in history[-1].bytes_by_channel() or mode == "pp"  # dp's gradients still meet on the host


@pytest.mark.parametrize("name,mode,devices", [("resnet", "pp", 1), ("gpt2", "dp", 2)])
def test_a_checkpoint_of_kept_state_resumes_as_the_uninterrupted_run(tmp_path, name, mode, devices):
    """(dp: the replicas' state is written back once, by the lowest device.)"""
    model, get_batch, plan = plan_for(name, mode, devices)
    assert set(kept_on(plan.tasks)) == set(range(devices))
    data = batches(get_batch, 4)
    with harmony.Trainer(plan, optimizer=adam, timeout=20) as whole:
        straight = [whole.step(x, y) for x, y in data]
        final = whole.state_dict()
    with harmony.Trainer(plan, optimizer=adam, timeout=20) as first:
        for x, y in data[:2]:
            first.step(x, y)
        path = first.save_checkpoint(tmp_path / "step2.pt")
        first.step(*data[2])  # the kept state moves on after the save: the file must not
    with harmony.Trainer(plan, optimizer=adam, timeout=20) as second:
        second.step(*data[0])  # its devices keep state of another history, which loading must replace
        assert second.load_checkpoint(path) == 2
        resumed = [second.step(x, y) for x, y in data[2:]]
        state = second.state_dict()
    assert resumed == straight[2:]
    for name, want in final.items():
        assert torch.equal(state[name], want), name


def test_loaded_weights_replace_the_kept_ones_and_closing_writes_them_back():
    model, get_batch, plan = plan_for("gpt2", "pp", 1)
    _, _, moved = plan_for("gpt2", "pp", 1, keep=False)  # the same run with nothing kept: what it must equal
    assert kept_on(plan.tasks) and not kept_on(moved.tasks)
    data = batches(get_batch, 3)
    start = copy.deepcopy(model.state_dict())
    finals = []
    for p in (plan, moved):
        with harmony.Trainer(p, optimizer=adam, timeout=20) as trainer:
            trainer.step(*data[0])
            trainer.load_state_dict(start)  # back to the first weights (the optimizer state carries on)
            assert all(torch.equal(trainer.state_dict()[k], v) for k, v in start.items())
            trainer.step(*data[1])
            stepped = trainer.state_dict()
            trainer.step(*data[2])
            store = trainer.store
        finals.append(store.state_dict(p.graph))  # the last step's state, written back by close()
    assert any(not torch.equal(finals[0][k], stepped[k]) for k in stepped)
    for name, want in finals[1].items():
        assert torch.allclose(finals[0][name], want, rtol=1e-12, atol=0), name


def test_without_keeping_the_same_plan_moves_its_state_every_iteration():
    _, _, kept = plan_for("gpt2", "pp", 1)
    _, _, moved = plan_for("gpt2", "pp", 1, keep=False)
    assert kept_on(kept.tasks) and not kept_on(moved.tasks)
    assert moved.tasks.bytes_by_channel().get("SWAP in", 0) > kept.tasks.bytes_by_channel().get("SWAP in", 0)


def generated(name: str, packs: list[tuple[int, int]], devices: int, **options) -> Plan:
    """The ample-room plan of ``name`` regenerated with ``packs`` for both passes, kept."""

    _, _, base = compiled(name)
    tasks = generate("pp", base.profile, Configuration(u_f=4, packs_f=packs, u_b=4, packs_b=packs), devices,
                     MINIBATCH, update="device", keep=True, **options)
    plan = Plan(graph=base.graph, profile=base.profile, tasks=tasks, estimate={},
                options={**base.options, "devices": devices, "mode": "pp"})
    plan.loss_fn, plan.build_optimizer = MODELS[name].loss_fn, adam
    plan.promise_memory()
    return plan


def test_a_tied_weight_kept_across_two_packs_of_one_device_is_one_tensor_stepped_once():
    """GPT-2's embedding is also its output projection: the head's pack hands its gradient over
    through host memory, the embedding's pack steps the one kept tensor both packs read."""
    model, get_batch, _ = compiled("gpt2")
    plan = generated("gpt2", [(0, 2), (3, 4)], 1)
    assert kept_on(plan.tasks) == {0: set(range(5))}, plan.tasks.to_text()
    history = trains_as_eager(model, get_batch, plan, 3)
    assert max(step.workers[0].peak for step in history) <= plan.tasks.memory.devices[0]


def test_kept_state_is_clipped_and_stepped_after_the_hosts_norm():
    """Clipping: every update waits for the host's NORM task, so the devices step their kept packs in
    UPD tasks with the clipped gradient summed in host memory."""
    model, get_batch, _ = compiled("resnet")
    plan = generated("resnet", [(0, 2), (3, 4)], 2, gated=True)
    assert set(kept_on(plan.tasks)) == {0, 1}, plan.tasks.to_text()
    data = batches(get_batch, 3)
    with harmony.Trainer(plan, optimizer=adam, timeout=20, clip_grad_norm=0.05) as trainer:
        losses = [trainer.step(x, y) for x, y in data]
        state = trainer.state_dict()
        norms = [step.grad_norm for step in trainer.history]
    reference = copy.deepcopy(model)
    expected_norms: list[float] = []
    expected = reference_train(reference, plan.loss_fn, adam, data, microbatches_of(plan.tasks), clip_grad_norm=0.05,
                               grad_norms=expected_norms)
    assert_same_training(losses, expected, state, reference.state_dict(), tolerance=1e-9)
    assert norms == pytest.approx(expected_norms, rel=1e-9) and min(norms) > 0.05


def test_kept_state_lost_with_a_worker_is_an_error_not_stale_weights(tmp_path):
    """A worker killed between steps takes the state its device kept: the trainer must not hand out
    the host store's older copy as the run's weights, nor save it as a checkpoint."""
    import os
    import signal

    from harmony.errors import HarmonyError
    from harmony.runtime.launcher import WorkerError

    _, get_batch, plan = plan_for("resnet", "pp", 1)
    data = batches(get_batch, 3)
    with harmony.Trainer(plan, optimizer=adam, timeout=20) as trainer:
        trainer.step(*data[0])
        trainer.state_dict()  # written back after iteration 1
        trainer.step(*data[1])
        os.kill(trainer.launcher.processes[0].pid, signal.SIGKILL)
        with pytest.raises(WorkerError):
            trainer.step(*data[2])
        with pytest.raises(HarmonyError, match="host store holds the state after iteration 1, not 2"):
            trainer.state_dict()
        with pytest.raises(HarmonyError, match="run stopped before writing them back"):
            trainer.save_checkpoint(tmp_path / "lost.pt")
    assert not (tmp_path / "lost.pt").exists()


def test_a_device_keeping_one_pack_and_moving_the_other_trains_as_eager():
    """Partial keeping: the device has room for one pack's state beside its work, not for both."""

    model, get_batch, base = compiled("resnet")  # (gpt2's tied embedding spans both packs)
    packs = [(0, 2), (3, 4)]
    graph = generate("pp", base.profile, Configuration(u_f=4, packs_f=packs, u_b=4, packs_b=packs), 1, MINIBATCH,
                     update="device")
    full = keep_state(graph, base.profile, None)
    kept = None
    for room in range(64 * 1024 * 1024, 0, -16 * 1024):  # the largest room that keeps a part only
        kept = keep_state(graph, base.profile, room, partial=True)
        if kept is None or kept_on(kept) != kept_on(full):
            break
    assert kept is not None and kept_on(kept) and kept_on(kept) != kept_on(full), "no room keeps one pack only"
    plan = one_device_plan(base, kept, MODELS["resnet"].loss_fn)
    history = trains_as_eager(model, get_batch, plan, 3)
    assert history[-1].bytes_by_channel() == {k: v for k, v in plan.tasks.bytes_by_channel().items() if v}


def test_a_host_updated_plan_stepping_its_boundary_packs_on_the_device_trains_as_eager():
    """The packs at the iteration's boundary (the first, and the head holding the embedding's tied
    weight) stepped and kept on the device, the pack between them stepped on the host."""

    model, get_batch, base = compiled("gpt2")
    packs = [(0, 0), (1, 3), (4, 4)]
    config = Configuration(u_f=4, packs_f=packs, u_b=4, packs_b=packs)
    steps = boundary_steps(base.profile, config)
    assert steps == ((0, 0), (4, 4))  # the embedding's weight is tied to the head's
    graph = keep_state(generate("pp", base.profile, config, 1, MINIBATCH, update="host", device_steps=steps),
                       base.profile, None)
    assert kept_on(graph) == {0: {0, 4}}
    assert [(t.first, t.last) for t in graph.tasks if t.kind == Kind.UPD and t.device == HOST] == [(1, 3)]
    plan = one_device_plan(base, graph, MODELS["gpt2"].loss_fn)
    history = trains_as_eager(model, get_batch, plan, 3)
    assert history[-1].bytes_by_channel() == {k: v for k, v in plan.tasks.bytes_by_channel().items() if v}


def test_a_head_holding_only_the_embeddings_tied_weight_is_kept_with_it_and_trains_as_eager():
    """Llama with tied embeddings, its head in a pack of its own: that pack's one weight is the
    embedding's, stepped by the first pack; the head is kept beside it rather than both let go."""
    import dataclasses

    from harmony.models import llama

    torch.manual_seed(0)
    model = llama.Llama(dataclasses.replace(llama.PRESETS["tiny"], tie_embeddings=True)).double()
    get_batch = functools.partial(llama.get_batch, preset="tiny", dtype="float64")
    graph = harmony.decompose(model, get_batch(2, 0)[0])
    capacity = 3 * training_footprint(graph, get_batch, MINIBATCH)
    base = harmony.compile(model, llama.loss_fn, get_batch, minibatch_size=MINIBATCH, devices=1,
                           device_memory=capacity, build_optimizer=adam, probe=False)
    head = len(base.graph) - 1
    assert [tie.layers for tie in base.profile.ties] == [[0, head]]
    packs = [(0, head - 1), (head, head)]
    tasks = keep_state(generate("pp", base.profile, Configuration(u_f=4, packs_f=packs, u_b=4, packs_b=packs), 1,
                                MINIBATCH, update="device"), base.profile, None)
    assert tasks is not None and kept_on(tasks) == {0: set(range(head + 1))}
    plan = one_device_plan(base, tasks, llama.loss_fn)
    trains_as_eager(model, get_batch, plan, 3)
