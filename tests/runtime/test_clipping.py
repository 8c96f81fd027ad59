"""Global-norm gradient clipping: a plan that clips trains exactly as eager training that calls
``torch.nn.utils.clip_grad_norm_`` before each step (float64, 2 emulated devices below a third of
the training footprint, pp and dp, device and host updates), reports the same norms, and moves the
bytes it planned. The threshold lies between the minibatches' norms, so some steps clip and some
do not."""

from __future__ import annotations

import copy

import pytest
import torch
from test_frozen import build as build_frozen
from test_frozen import compiled as compiled_frozen
from test_training import MINIBATCH, adam, assert_same_training, compiled

import harmony
from harmony.errors import HarmonyError
from harmony.plan import Plan
from harmony.runtime.reference import microbatches_of, reference_train
from harmony.scheduler.estimator import estimate
from harmony.scheduler.search import search
from harmony.scheduler.taskgraph import with_norm
from harmony.scheduler.modes import generate
from harmony.scheduler.tasks import HOST, Kind
from harmony.scheduler.machine import nominal_machine

MAX_NORM = 1.2  # gpt2 tiny's first minibatch has a norm of about 1.13, the next ones 1.27-1.28
ITERATIONS = 4


def clipped_plan(base: Plan, mode: str, update: str | None) -> Plan:
    machine = nominal_machine("cpu", 2, base.profile.capacity)
    result = search(base.profile, machine, mode, 2, MINIBATCH, capacity=base.options["planned_memory"],
                    same_u=bool(base.options["same_u"]), gated=True)
    tasks = result.graph
    if update is not None:
        tasks = generate(mode, base.profile, result.graph.config, 2, MINIBATCH, update=update, gated=True)
    plan = Plan(graph=base.graph, profile=base.profile, tasks=tasks, estimate={},
                options={**base.options, "devices": 2, "mode": mode, "clip_grad_norm": MAX_NORM})
    plan.loss_fn, plan.build_optimizer = base.loss_fn, adam
    plan.promise_memory()
    return plan


def train_both(model, get_batch, plan: Plan, max_norm: float = MAX_NORM):
    reference = copy.deepcopy(model)
    batches = [get_batch(MINIBATCH, step) for step in range(ITERATIONS)]
    with harmony.Trainer(plan, optimizer=adam, timeout=30, clip_grad_norm=max_norm) as trainer:
        losses = [trainer.step(x, y) for x, y in batches]
        state, history, last = trainer.state_dict(), trainer.history, trainer.grad_norm
    norms: list[float] = []
    expected = reference_train(reference, plan.loss_fn, adam, batches, microbatches_of(plan.tasks),
                               clip_grad_norm=max_norm, grad_norms=norms)
    assert last == history[-1].grad_norm
    return losses, expected, state, reference.state_dict(), history, norms


@pytest.mark.parametrize("mode, update", [("pp", "device"), ("pp", "host"), ("dp", "device"), ("dp", "host"),
                                          ("dp-swap", None), ("1f1b-swap", None)])
def test_a_clipped_run_equals_eager_training_with_clip_grad_norm(mode, update):
    model, get_batch, base = compiled("gpt2")
    plan = clipped_plan(base, mode, update)
    losses, expected, state, reference, history, norms = train_both(model, get_batch, plan)
    assert min(norms) < MAX_NORM < max(norms), norms  # both branches: unclipped and clipped steps
    assert_same_training(losses, expected, state, reference, tolerance=1e-9)
    got = [step.grad_norm for step in history]
    assert got == pytest.approx(norms, rel=1e-12)
    assert history[-1].bytes_by_channel() == {k: v for k, v in plan.tasks.bytes_by_channel().items() if v}
    for step in history:
        assert max(w.peak for w in step.workers) <= plan.options["device_memory"]


def test_clipping_leaves_frozen_parameters_out_of_the_norm():
    _, get_batch, base = compiled_frozen(True)
    plan = clipped_plan(base, "pp", "device")
    losses, expected, state, reference, history, norms = train_both(build_frozen(True), get_batch, plan)
    assert_same_training(losses, expected, state, reference, tolerance=1e-9)
    assert [step.grad_norm for step in history] == pytest.approx(norms, rel=1e-12)


def test_a_threshold_above_every_norm_changes_nothing():
    """Bitwise against the same configuration unclipped (the gradients add up in the same order);
    against eager unclipped training to float64 rounding (dp adds each device's microbatches
    before the devices' sums, eager adds them one by one: equal only where each device runs one)."""
    model, get_batch, base = compiled("gpt2")
    plan = clipped_plan(base, "dp", "host")
    clipped, _, state, *_ = train_both(model, get_batch, plan, max_norm=1e6)
    unclipped = Plan(graph=base.graph, profile=base.profile, estimate={}, options={**base.options, "mode": "dp"},
                     tasks=generate("dp", base.profile, plan.tasks.config, 2, MINIBATCH, update="host"))
    unclipped.loss_fn = base.loss_fn
    unclipped.promise_memory()
    batches = [get_batch(MINIBATCH, step) for step in range(ITERATIONS)]
    with harmony.Trainer(unclipped, optimizer=adam, timeout=30) as trainer:
        assert [trainer.step(x, y) for x, y in batches] == clipped
        assert all(torch.equal(v, state[k]) for k, v in trainer.state_dict().items())
    reference = copy.deepcopy(model)
    plain = reference_train(reference, plan.loss_fn, adam, batches, microbatches_of(plan.tasks))
    assert_same_training(clipped, plain, state, reference.state_dict(), tolerance=1e-9)


@pytest.mark.parametrize("mode, update", [("pp", "device"), ("pp", "host"), ("dp", "device"), ("dp", "host"),
                                          ("dp-swap", None), ("1f1b-swap", None)])
def test_every_update_waits_for_the_norm_and_none_is_fused_into_a_backward(mode, update):
    _, _, base = compiled("gpt2")
    config = search(base.profile, nominal_machine("cpu", 2, base.profile.capacity),
                    mode, 2, MINIBATCH, capacity=base.options["planned_memory"], same_u=True).config
    options = {"update": update} if update else {}
    graph = generate(mode, base.profile, config, 2, MINIBATCH, gated=True, **options)
    norm = [t for t in graph.tasks if t.kind == Kind.NORM]
    assert len(norm) == 1 and norm[0].device == HOST
    gradients = {t.id for t in graph.tasks if t.kind == Kind.BWD and any(o.tensor == "dW" for o in t.outputs)}
    assert norm[0].deps() == gradients
    updates = [t for t in graph.tasks if t.kind == Kind.UPD]
    assert updates and all(norm[0].id in t.deps() for t in updates)
    assert not [t for t in graph.tasks if t.jit_update()]
    assert [t.id for t in graph.tasks] == list(range(len(graph.tasks)))
    est = estimate(graph, base.profile, nominal_machine("cpu", 2, base.profile.capacity))
    assert est.fits and not est.deadlock


def test_with_norm_refuses_a_graph_that_steps_inside_its_backward():
    _, _, base = compiled("gpt2")
    plan = clipped_plan(base, "pp", "device")
    fused = generate("pp", base.profile, plan.tasks.config, 2, MINIBATCH, update="device")
    assert any(t.jit_update() for t in fused.tasks)
    with pytest.raises(ValueError, match="steps its pack inside its backward"):
        with_norm(fused)


def test_clipping_a_plan_compiled_without_it_is_refused_with_what_to_do():
    model, get_batch, base = compiled("gpt2")
    plan = Plan(graph=base.graph, profile=base.profile,
                tasks=generate("pp", base.profile, base.tasks.config, 1, MINIBATCH, update="device"),
                estimate={}, options={**base.options, "devices": 1})
    plan.loss_fn, plan.build_optimizer = base.loss_fn, adam
    with pytest.raises(HarmonyError, match="compiled without clipping.*--clip-grad-norm"):
        harmony.Trainer(plan, optimizer=adam, clip_grad_norm=1.0)
    clipping = clipped_plan(base, "dp", "host")
    with pytest.raises(HarmonyError, match="must be a positive number"):
        harmony.Trainer(clipping, optimizer=adam, clip_grad_norm=-1.0)


def test_compile_takes_the_threshold_into_the_plan_and_the_trainer_uses_it(tmp_path):
    model, get_batch, base = compiled("gpt2")
    plan = harmony.compile(model, base.loss_fn, get_batch, minibatch_size=MINIBATCH, devices=2,
                           device_memory=base.options["device_memory"], build_optimizer=adam, probe=False,
                           clip_grad_norm=MAX_NORM)
    assert plan.options["clip_grad_norm"] == MAX_NORM
    assert any(t.kind == Kind.NORM for t in plan.tasks.tasks)
    plan.save(tmp_path / "plan")
    loaded = harmony.load_plan(tmp_path / "plan")
    assert loaded.options["clip_grad_norm"] == MAX_NORM and str(loaded.tasks.tasks) == str(plan.tasks.tasks)
    with harmony.Trainer(plan, optimizer=adam, timeout=30) as trainer:
        trainer.step(*get_batch(MINIBATCH, 0))
        assert trainer.clip_grad_norm == MAX_NORM and trainer.grad_norm > 0
    with pytest.raises(HarmonyError, match="clip_grad_norm must be a positive number"):
        harmony.compile(model, base.loss_fn, get_batch, minibatch_size=MINIBATCH, devices=2,
                        device_memory=base.options["device_memory"], probe=False, clip_grad_norm=0)
