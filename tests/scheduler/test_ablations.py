"""The ablation switches of the task graphs (Fig. 14: grouping, jit-update, p2p swaps off).

Each switched-off graph must change the way it says it does (checked on a synthetic profile), and
must still train exactly: the tiny GPT-2 (tied embedding, dropout on) on 2 emulated devices in
float64 gives the losses and parameters of the single-process eager reference, and the runtime
moves the bytes the graph plans.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import harmony
from harmony.models import gpt2
from harmony.plan import Plan
from harmony.runtime.reference import microbatches_of, reference_train
from harmony.scheduler.estimator import estimate
from harmony.scheduler.machine import Machine
from harmony.scheduler.search import search
from harmony.scheduler.modes import generate
from harmony.scheduler.tasks import HOST, Channel, Configuration, Kind

MINIBATCH = 8
CONFIG = Configuration(u_f=4, packs_f=[(0, 1), (2, 2), (3, 4)], u_b=4, packs_b=[(0, 0), (1, 2), (3, 4)])


def _synthetic_graph(uniform, mode="pp", **switches):
    profile = uniform(layers=5)
    return profile, generate(mode, profile, CONFIG, 2, MINIBATCH, **switches)


def _compute_tasks(graph):
    return [t for t in graph.tasks if t.kind != Kind.UPD]


def test_grouping_off_splits_every_task_into_one_per_microbatch_that_swaps_its_weights(uniform):
    profile, grouped = _synthetic_graph(uniform)
    _, split = _synthetic_graph(uniform, grouping=False)
    assert all(len(t.microbatches) == 2 for t in _compute_tasks(grouped))
    assert all(len(t.microbatches) == 1 for t in _compute_tasks(split))
    assert len(_compute_tasks(split)) == 2 * len(_compute_tasks(grouped))
    assert split.swap_bytes("W") > grouped.swap_bytes("W")
    assert split.swap_bytes("dW") > grouped.swap_bytes("dW")  # microbatch gradients add up in host memory
    assert grouped.swap_bytes("X") + grouped.swap_bytes("Xs") == split.swap_bytes("X") + split.swap_bytes("Xs")
    assert estimate(split, profile, Machine.from_spec("1080ti", 2)).fits


def test_grouping_off_needs_equal_forward_and_backward_microbatches(uniform):
    profile = uniform(layers=5)
    config = Configuration(u_f=2, packs_f=CONFIG.packs_f, u_b=4, packs_b=CONFIG.packs_b)
    with pytest.raises(ValueError, match="U_F"):
        generate("pp", profile, config, 2, MINIBATCH, grouping=False)


def test_jit_update_off_steps_every_pack_on_its_device_after_the_whole_backward(uniform):
    _, graph = _synthetic_graph(uniform, jit_update=False)
    assert not any(t.update == "device" for t in graph.tasks)
    updates = [t for t in graph.tasks if t.kind == Kind.UPD]
    assert len(updates) == len(CONFIG.packs_b) and all(t.device != HOST for t in updates)
    for device in range(2):
        kinds = [t.kind for t in graph.device_tasks(device)]
        first_update = kinds.index(Kind.UPD)
        assert Kind.BWD not in kinds[first_update:], f"dev{device} runs a backward after an update"


def test_p2p_off_sends_everything_between_devices_through_host_memory(uniform):
    _, with_p2p = _synthetic_graph(uniform)
    _, without = _synthetic_graph(uniform, p2p=False)
    p2p = [t for task in with_p2p.tasks for t in task.inputs if t.channel == Channel.P2P]
    assert p2p, "the default pp graph has p2p transfers to turn off"
    assert not any(t.channel == Channel.P2P for task in without.tasks for t in (*task.inputs, *task.outputs))
    moved = sum(t.nbytes for t in p2p)
    assert without.swap_bytes() == with_p2p.swap_bytes() + 2 * moved  # out to the host and back in


def test_the_defaults_are_the_optimizations_on(uniform):
    _, default = _synthetic_graph(uniform)
    _, explicit = _synthetic_graph(uniform, grouping=True, jit_update=True, p2p=True)
    assert default.to_text() == explicit.to_text()


def test_search_passes_the_switches_to_the_graph(uniform):
    profile = uniform(layers=5)
    machine = Machine.from_spec("1080ti", 2)
    result = search(profile, machine, "pp", 2, MINIBATCH, p2p=False, jit_update=False)
    assert not any(t.channel == Channel.P2P for task in result.graph.tasks for t in task.inputs)
    assert any(t.kind == Kind.UPD for t in result.graph.tasks)


# ------------------------------------------------------------------ training
def adam(params):
    return torch.optim.Adam(params, lr=1e-3, eps=1e-6)


@functools.lru_cache(maxsize=None)
def _compiled():
    torch.manual_seed(0)
    model = gpt2.build_model("tiny", dtype="float64")
    get_batch = functools.partial(gpt2.get_batch, preset="tiny", dtype="float64")
    plan = harmony.compile(model, gpt2.loss_fn, get_batch, minibatch_size=MINIBATCH, devices=1,
                           device_memory=64 << 20, build_optimizer=adam, probe=False)
    return model, get_batch, plan


def _counted(history) -> dict[str, int]:
    return history[-1].bytes_by_channel()


@pytest.mark.parametrize("mode,switches", [
    ("pp", {"grouping": False}), ("pp", {"jit_update": False}), ("pp", {"p2p": False}),
    ("pp", {"grouping": False, "update": "host"}), ("dp", {"grouping": False}),
])
def test_switched_off_graph_trains_exactly_like_eager_pytorch(mode, switches):
    model, get_batch, base = _compiled()
    assert len(base.profile.layers) == 5 and base.profile.ties, "the config below is for the tiny GPT-2's 5 tied layers"
    tasks = generate(mode, base.profile, CONFIG, 2, MINIBATCH, **switches)
    tasks.validate()
    plan = Plan(graph=base.graph, profile=base.profile, tasks=tasks, estimate={},
                options={**base.options, "devices": 2, "mode": mode})
    plan.loss_fn = gpt2.loss_fn
    reference = copy.deepcopy(model)
    batches = [get_batch(MINIBATCH, step) for step in range(3)]
    with harmony.Trainer(plan, optimizer=adam, timeout=30) as trainer:
        losses = [trainer.step(*batch) for batch in batches]
        state = trainer.state_dict()
        history = trainer.history
    expected = reference_train(reference, gpt2.loss_fn, adam, batches, microbatches_of(tasks))
    for got, want in zip(losses, expected):
        assert abs(got - want) <= 1e-9 * abs(want)
    for name, want in reference.state_dict().items():
        if want.is_floating_point():
            scale = want.abs().max().clamp_min(1e-3)
            assert float((state[name] - want).abs().max() / scale) <= 1e-9, name
    assert _counted(history) == {k: v for k, v in tasks.bytes_by_channel().items() if v}
