"""Learning-rate schedules: every update of a minibatch, on a device or on the host, runs at the
rate the user's scheduler gives, as eager training with that scheduler does (float64, 2 emulated
devices below a third of the training footprint); checkpoints carry the schedule."""

from __future__ import annotations

import copy

import pytest
import torch
from test_training import MINIBATCH, assert_same_training, plan_for

import harmony
from harmony.errors import HarmonyError
from harmony.runtime.reference import microbatches_of, reference_train
from harmony.runtime.lr_schedule import Schedule, apply


def two_groups(params):
    """Matrices and vectors in groups of their own base rates: a rate per parameter matters."""
    params = list(params)
    return torch.optim.Adam([{"params": [p for p in params if p.dim() > 1], "lr": 2e-3},
                             {"params": [p for p in params if p.dim() <= 1], "lr": 5e-4}], eps=1e-6)


def warmup_then_decay(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 2) * 0.7 ** step)


def one_cycle(opt):  # changes Adam's betas too
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[4e-3, 1e-3], total_steps=10)


def plateau(opt):
    return torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=10.0)


def train_both(mode: str, scheduler, iterations: int = 4, update: str | None = None):
    model, get_batch, plan = plan_for("gpt2", mode, 2)
    if update is not None:
        from harmony.scheduler.modes import generate
        plan.tasks = generate(mode, plan.profile, plan.tasks.config, 2, MINIBATCH, update=update)
        plan.promise_memory()
    reference = copy.deepcopy(model)
    batches = [get_batch(MINIBATCH, step) for step in range(iterations)]
    with harmony.Trainer(plan, optimizer=two_groups, timeout=30, lr_scheduler=scheduler) as trainer:
        losses = [trainer.step(x, y) for x, y in batches]
        state, last_lr = trainer.state_dict(), trainer.lr_scheduler.get_last_lr()
    expected = reference_train(reference, plan.loss_fn, two_groups, batches, microbatches_of(plan.tasks),
                               lr_scheduler=scheduler)
    return losses, expected, state, reference.state_dict(), last_lr, plan


@pytest.mark.parametrize("scheduler", [warmup_then_decay, one_cycle, plateau], ids=lambda f: f.__name__)
@pytest.mark.parametrize("mode", ["pp", "dp"])
def test_a_scheduled_run_equals_eager_training_with_the_same_scheduler(mode, scheduler):
    losses, expected, state, reference, last_lr, plan = train_both(mode, scheduler)
    assert_same_training(losses, expected, state, reference, tolerance=1e-9)


@pytest.mark.parametrize("update", ["device", "host"])
def test_device_and_host_updates_both_follow_the_schedule(update):
    losses, expected, state, reference, _, plan = train_both("dp", warmup_then_decay, update=update)
    on_host = [t for t in plan.tasks.tasks if t.kind.value == "UPD" and t.device < 0]
    assert bool(on_host) == (update == "host")
    assert_same_training(losses, expected, state, reference, tolerance=1e-9)


def test_a_run_without_a_schedule_differs_from_a_scheduled_one():
    losses, expected, state, reference, _, _ = train_both("pp", warmup_then_decay, iterations=3)
    model, get_batch, plan = plan_for("gpt2", "pp", 2)
    with harmony.Trainer(plan, optimizer=two_groups, timeout=30) as trainer:
        plain = [trainer.step(*get_batch(MINIBATCH, step)) for step in range(3)]
    assert plain[:1] != losses[:1] or plain[1:] != losses[1:]


def test_a_checkpoint_resumes_the_schedule_where_it_stopped(tmp_path):
    model, get_batch, plan = plan_for("gpt2", "pp", 2)
    batches = [get_batch(MINIBATCH, step) for step in range(4)]
    with harmony.Trainer(plan, optimizer=two_groups, timeout=30, lr_scheduler=warmup_then_decay) as trainer:
        straight = [trainer.step(x, y) for x, y in batches]
        want = trainer.state_dict()
    with harmony.Trainer(plan, optimizer=two_groups, timeout=30, lr_scheduler=warmup_then_decay) as trainer:
        first = [trainer.step(x, y) for x, y in batches[:2]]
        path = trainer.save_checkpoint(tmp_path / "half.pt")
    with harmony.Trainer(plan, optimizer=two_groups, timeout=30, lr_scheduler=warmup_then_decay) as trainer:
        assert trainer.load_checkpoint(path) == 2
        assert trainer.lr_scheduler.last_epoch == 2
        rest = [trainer.step(x, y) for x, y in batches[2:]]
        got = trainer.state_dict()
    assert first + rest == straight
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_a_checkpoint_saved_without_a_schedule_resumes_at_its_step_of_the_schedule(tmp_path):
    model, get_batch, plan = plan_for("gpt2", "pp", 2)
    with harmony.Trainer(plan, optimizer=two_groups, timeout=30) as trainer:
        trainer.step(*get_batch(MINIBATCH, 0))
        trainer.step(*get_batch(MINIBATCH, 1))
        path = trainer.save_checkpoint(tmp_path / "plain.pt")
    with harmony.Trainer(plan, optimizer=two_groups, timeout=30, lr_scheduler=warmup_then_decay) as trainer:
        trainer.load_checkpoint(path)
        fresh = warmup_then_decay(two_groups([torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))]))
        for _ in range(2):
            fresh.optimizer.step()
            fresh.step()
        assert trainer.lr_scheduler.get_last_lr() == fresh.get_last_lr()


def test_a_checkpoint_of_another_scheduler_is_refused_naming_the_file(tmp_path):
    model, get_batch, plan = plan_for("gpt2", "pp", 2)
    with harmony.Trainer(plan, optimizer=two_groups, timeout=30, lr_scheduler=warmup_then_decay) as trainer:
        trainer.step(*get_batch(MINIBATCH, 0))
        path = trainer.save_checkpoint(tmp_path / "s.pt")
    one_group = lambda ps: torch.optim.Adam(ps, lr=1e-3)  # noqa: E731
    with harmony.Trainer(plan, optimizer=one_group, timeout=30, lr_scheduler=warmup_then_decay) as trainer:
        with pytest.raises(HarmonyError, match="s.pt holds a learning-rate schedule"):
            trainer.load_checkpoint(path)


def test_apply_gives_each_group_the_rate_of_its_parameters():
    a, b = torch.nn.Parameter(torch.zeros(3, 3)), torch.nn.Parameter(torch.zeros(3))
    schedule = Schedule({"a": (3, 3), "b": (3,)}, two_groups, warmup_then_decay)
    schedule.step(0.0)
    rates = schedule.rates()
    opt = two_groups([b, a])
    apply(opt, {"b": b, "a": a}, rates)
    lrs = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    assert lrs[id(a)] == pytest.approx(2e-3 * 0.7) and lrs[id(b)] == pytest.approx(5e-4 * 0.7)
    assert rates["a"]["lr"] == lrs[id(a)]


def test_a_scheduler_builder_that_returns_no_scheduler_is_a_clear_error():
    with pytest.raises(HarmonyError, match="returned Adam, not a torch.optim.lr_scheduler"):
        Schedule({"a": (2, 2)}, two_groups, lambda opt: opt)
    with pytest.raises(HarmonyError, match="building the learning-rate schedule .* failed: ValueError"):
        Schedule({"a": (2, 2)}, two_groups, lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[1.0]))
