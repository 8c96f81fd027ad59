"""The runtime beyond one device's memory, across microbatch sizes, and out of memory.

- A GPT-2 whose training footprint is 8x one device's capacity trains on 2 emulated devices with
  the reference's losses and weights.
- U_F != U_B: activations are cut and joined by samples between packs of different microbatch
  sizes, exactly (a model without dropout or BatchNorm, which is when the search allows it).
- A device given less memory than its plan needs fails with an error naming the device.
"""

from __future__ import annotations

import copy

import pytest
import torch

import harmony
from harmony.compiler import batch_coupled
from harmony.models import gpt2
from harmony.models.gpt2 import GPT, GPTConfig
from harmony.plan import Plan
from harmony.profiling.sweep import training_footprint
from harmony.runtime.launcher import WorkerError
from harmony.runtime.reference import microbatches_of, reference_train
from harmony.scheduler.modes import generate
from harmony.scheduler.tasks import Configuration

MINIBATCH = 16


def adam(params):
    return torch.optim.Adam(params, lr=1e-3, eps=1e-6)


def get_batch(batch_size: int, step: int):
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 128, (batch_size, 33), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def small_gpt(dropout: float = 0.1) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=128, block_size=32, dropout=dropout)).double()


def assert_matches(losses, expected, state, reference) -> None:
    assert losses == pytest.approx(expected, rel=1e-9)
    for name, want in reference.items():
        err = float((state[name] - want).abs().max() / want.abs().max().clamp_min(1e-3))
        assert err <= 1e-9, f"{name}: {err:.3g}"


def test_model_eight_times_a_device_trains_on_two_devices_like_the_reference():
    model = small_gpt()
    graph = harmony.decompose(model, get_batch(2, 0)[0])
    footprint = training_footprint(graph, get_batch, MINIBATCH)
    plan = harmony.compile(model, gpt2.loss_fn, get_batch, minibatch_size=MINIBATCH, devices=2,
                           device_memory=footprint // 8, build_optimizer=adam, probe=False)
    batches = [get_batch(MINIBATCH, step) for step in range(3)]
    with harmony.Trainer(plan, optimizer=adam, timeout=60) as trainer:
        losses = [trainer.step(*batch) for batch in batches]
        state = trainer.state_dict()
        peaks = [w.peak for step in trainer.history for w in step.workers]
    reference = copy.deepcopy(model)
    expected = reference_train(reference, gpt2.loss_fn, adam, batches, microbatches_of(plan.tasks))
    assert_matches(losses, expected, state, reference.state_dict())
    assert max(peaks) <= footprint // 8 < footprint / 8 + 1


def test_forward_and_backward_microbatches_of_different_sizes_train_exactly():
    model = small_gpt(dropout=0.0)
    base = harmony.compile(model, gpt2.loss_fn, get_batch, minibatch_size=MINIBATCH, devices=2,
                           build_optimizer=adam, probe=False)
    assert not batch_coupled(base.graph)
    n = len(base.graph.layers)
    config = Configuration(u_f=3, packs_f=[(0, 2), (3, n - 1)], u_b=2, packs_b=[(0, 1), (2, 2), (3, n - 1)])
    tasks = generate("pp", base.profile, config, 2, MINIBATCH, update="device")
    plan = Plan(graph=base.graph, profile=base.profile, tasks=tasks, estimate={},
                options={**base.options, "device_memory": 10**9})
    plan.loss_fn = gpt2.loss_fn
    batches = [get_batch(MINIBATCH, step) for step in range(3)]
    with harmony.Trainer(plan, optimizer=adam, timeout=60) as trainer:
        losses = [trainer.step(*batch) for batch in batches]
        state = trainer.state_dict()
        counted: dict[str, int] = {}
        for worker in trainer.history[-1].workers:
            for key, value in worker.bytes_by_channel.items():
                counted[key] = counted.get(key, 0) + value
    reference = copy.deepcopy(model)
    expected = reference_train(reference, gpt2.loss_fn, adam, batches, microbatches_of(plan.tasks))
    assert_matches(losses, expected, state, reference.state_dict())
    counted.pop("TARGET in", None)
    assert counted == {k: v for k, v in tasks.bytes_by_channel().items() if v}


def test_dropout_and_batchnorm_keep_forward_and_backward_microbatches_equal():
    from harmony.models import resnet

    assert "random" in batch_coupled(harmony.decompose(small_gpt(), get_batch(2, 0)[0]))
    net = resnet.build_model("tiny")
    assert "BatchNorm" in batch_coupled(harmony.decompose(net, resnet.get_batch(2, 0)[0]))
    plan = harmony.compile(small_gpt(), gpt2.loss_fn, get_batch, minibatch_size=MINIBATCH, devices=2,
                           build_optimizer=adam, probe=False)
    assert plan.tasks.config.u_f == plan.tasks.config.u_b


def test_device_with_less_memory_than_planned_fails_naming_device_task_memory_and_the_remedy():
    model = small_gpt()
    plan = harmony.compile(model, gpt2.loss_fn, get_batch, minibatch_size=MINIBATCH, devices=2,
                           build_optimizer=adam, probe=False)
    plan.options = {**plan.options, "device_memory": plan.options["device_memory"] // 4}
    with harmony.Trainer(plan, optimizer=adam, timeout=30) as trainer:
        with pytest.raises(WorkerError, match=r"device \d ran out of memory in task \d+ \(dev\d (FWD|BWD)") as info:
            trainer.step(*get_batch(MINIBATCH, 0))
        assert not any(p.is_alive() for p in trainer.launcher.processes)
    message = str(info.value)
    assert "in use of its" in message and "the plan expected this task to peak at" in message
    assert "--memory-margin" in message
