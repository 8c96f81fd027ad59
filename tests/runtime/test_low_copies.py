"""Weights in low precision (``profiling/casts.py``): a bf16 plan moves and holds the weights
autocast only casts as bf16 copies cast on the host (frozen ones always, trainable ones where the
host steps them), half their float32 bytes in the plan's swaps and in what the run counts, and
trains as eager autocast training of the same partly frozen model (2 emulated devices below a
third of the training footprint, pp and dp; the tolerance of ``test_precision.py``, whose module
docs say why)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from test_precision import LOSS_TOLERANCE, MINIBATCH, TOLERANCE, adam, relative_distance

import harmony
from harmony.scheduler.machine import nominal_machine
from harmony.models import gpt2
from harmony.profiling.sweep import training_footprint
from harmony.runtime.reference import microbatches_of, reference_train
from harmony.scheduler.search import search
from harmony.scheduler.tasks import Channel, Kind

FROZEN = ("wte.", "wpe.", "h.0.")  # the embeddings (tied to the head: float32) and the first block
FROZEN_MATRIX = "h.1.attn.c_attn.weight"  # and one matrix of the second (its bias trains)


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    model = gpt2.build_model("tiny", dtype="float32")
    for name, p in model.named_parameters():
        p.requires_grad_(not (name.startswith(FROZEN) or name == FROZEN_MATRIX))
    return model


@functools.lru_cache(maxsize=None)
def plan_at(mode: str, precision: str = "bf16"):
    get_batch = functools.partial(gpt2.get_batch, preset="tiny")
    graph = harmony.decompose(build(), get_batch(2, 0)[0])
    capacity = int(0.3 * training_footprint(graph, get_batch, MINIBATCH))
    return harmony.compile(build(), gpt2.loss_fn, get_batch, minibatch_size=MINIBATCH, devices=2, mode=mode,
                           device_memory=capacity, build_optimizer=adam, probe=False, precision=precision)


@functools.lru_cache(maxsize=None)
def plan_updating_at(mode: str, update: str):
    """``plan_at``'s plan with its updates where ``update`` says (the search picks either), moving
    its state every iteration: these tests are about what travels, and how (kept state moves none)."""
    plan = plan_at(mode)
    machine = nominal_machine("cpu", 2, plan.profile.capacity)
    tasks = search(plan.profile, machine, mode, 2, MINIBATCH, capacity=plan.options["planned_memory"],
                   same_u=bool(plan.options["same_u"]), update=update, keep=False).graph
    tasks.precision = plan.tasks.precision
    return dataclasses.replace(plan, tasks=tasks)


def linear_weights(*prefixes: str) -> list[str]:
    return [n for n, _ in build().named_parameters() if n.startswith(prefixes) and ".ln_" not in n]


def test_the_frozen_linear_weights_and_no_others_travel_in_bf16_where_a_device_steps():
    low = plan_updating_at("pp", "device").tasks.low_copies
    assert sorted(low) == sorted(linear_weights("h.0.") + [FROZEN_MATRIX]) and set(low.values()) == {"bfloat16"}
    assert plan_at("pp", "fp32").tasks.low_copies == {}


@pytest.mark.parametrize("mode", ["pp", "dp"])
def test_trainable_linear_weights_travel_in_bf16_too_where_the_host_steps_them(mode):
    low = plan_updating_at(mode, "host").tasks.low_copies
    assert sorted(low) == sorted(linear_weights("h.")) and set(low.values()) == {"bfloat16"}


@pytest.mark.parametrize("mode,update", [("pp", "device"), ("pp", "host"), ("dp", "device"), ("dp", "host")])
def test_a_task_receives_its_low_copies_at_half_their_float32_bytes(mode, update):
    plan = plan_updating_at(mode, update)
    params = dict(build().named_parameters())
    checked = 0
    for task in plan.tasks.tasks:
        if task.kind not in (Kind.FWD, Kind.BWD):
            continue
        names = {plan.graph.canonical(n) for layer in plan.graph.layers[task.first:task.last + 1] for n in layer.state
                 if plan.graph.state[n].kind == "parameter"}
        expected = sum(params[n].numel() * (2 if n in plan.tasks.low_copies else 4) for n in names)
        swapped = [t.nbytes for t in task.inputs if t.tensor == "W" and t.channel == Channel.SWAP]
        assert swapped in ([expected], []), task
        checked += len(swapped)
    assert checked


def test_the_low_copies_are_part_of_the_saved_plan(tmp_path):
    plan = plan_updating_at("pp", "host")
    plan.save(tmp_path / "plan")
    loaded = harmony.load_plan(tmp_path / "plan")
    assert loaded.tasks.low_copies == plan.tasks.low_copies
    # the plan keeps the profile it searched from; the host variant's follows from it
    assert loaded.profile.to_dict() == plan.profile.to_dict()
    assert [c.name for c in loaded.profile.for_graph(loaded.tasks).low_copies] == list(plan.tasks.low_copies)
    frozen = len(linear_weights("h.0.")) + 1
    assert (f"- {len(plan.tasks.low_copies)} weights ({frozen} frozen, {len(plan.tasks.low_copies) - frozen} trainable "
            "and stepped on the host) move as bf16 copies") in (tmp_path / "plan" / "summary.md").read_text()


@pytest.mark.parametrize("mode,update", [("pp", "device"), ("pp", "host"), ("dp", "host")])
def test_a_bf16_run_with_weights_in_bf16_equals_eager_autocast_training(mode, update):
    plan = plan_updating_at(mode, update)
    get_batch = functools.partial(gpt2.get_batch, preset="tiny")
    batches = [get_batch(MINIBATCH, step) for step in range(3)]
    with harmony.Trainer(plan, optimizer=adam, timeout=30) as trainer:
        losses = [trainer.step(x, y) for x, y in batches]
        state, history = trainer.state_dict(), trainer.history
        # the copies the devices receive are the stepped masters cast as autocast casts
        store = trainer.store
        assert all(torch.equal(store.low_copy(n), store.weight(n).to(torch.bfloat16)) for n in plan.tasks.low_copies)
    reference = build()
    expected = reference_train(reference, gpt2.loss_fn, adam, batches, microbatches_of(plan.tasks), precision="bf16")
    assert losses == pytest.approx(expected, rel=LOSS_TOLERANCE)
    assert relative_distance(state, reference.state_dict()) <= TOLERANCE
    # the frozen weights come back as they were: the masters never see the bf16 copies
    untouched = build().state_dict()
    frozen = [n for n, p in build().named_parameters() if not p.requires_grad]
    assert all(torch.equal(state[n], untouched[n]) for n in frozen)
    planned = {k: v for k, v in plan.tasks.bytes_by_channel().items() if v}
    assert all(step.bytes_by_channel() == planned for step in history)
    assert all(max(w.peak for w in step.workers) <= plan.options["device_memory"] for step in history)


def test_a_host_updated_plan_stepping_a_pack_on_its_device_moves_only_that_packs_weights_in_float32():
    """One device, the host stepping the middle pack and the device the boundary packs (the first,
    with h.1, and the head tied to the embedding), their state kept: h.1's trainable matrices stay
    float32 masters on the device, h.2's travel as copies, and training equals eager autocast."""
    from harmony.scheduler.keep import keep_state
    from harmony.scheduler.memory import kept_on
    from harmony.scheduler.modes import generate
    from harmony.scheduler.search import boundary_steps
    from harmony.scheduler.tasks import Configuration

    base = plan_at("pp")
    packs = [(0, 2), (3, 3), (4, 4)]
    config = Configuration(u_f=4, packs_f=packs, u_b=4, packs_b=packs)
    graph = generate("pp", base.profile, config, 1, MINIBATCH, update="host",
                     device_steps=boundary_steps(base.profile, config))
    tasks = keep_state(graph, base.profile, None)
    assert kept_on(tasks) == {0: {0, 1, 2, 4}}
    assert sorted(tasks.low_copies) == sorted(linear_weights("h.0.", "h.2.") + [FROZEN_MATRIX])
    tasks.precision = base.tasks.precision
    plan = dataclasses.replace(base, tasks=tasks, options={**base.options, "devices": 1})
    plan.promise_memory()
    get_batch = functools.partial(gpt2.get_batch, preset="tiny")
    batches = [get_batch(MINIBATCH, step) for step in range(3)]
    with harmony.Trainer(plan, optimizer=adam, timeout=30) as trainer:
        losses = [trainer.step(x, y) for x, y in batches]
        state, history = trainer.state_dict(), trainer.history
    reference = build()
    expected = reference_train(reference, gpt2.loss_fn, adam, batches, microbatches_of(plan.tasks), precision="bf16")
    assert losses == pytest.approx(expected, rel=LOSS_TOLERANCE)
    assert relative_distance(state, reference.state_dict()) <= TOLERANCE
    planned = {k: v for k, v in plan.tasks.bytes_by_channel().items() if v}
    assert all(step.bytes_by_channel() == planned for step in history)
