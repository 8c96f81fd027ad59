"""The model's own inputs get no gradient, neither in the profile's backward trials nor in any
backward task, as in eager training: nobody reads it, and computing it would double a
convolutional stem's backward.

The first convolution of VGG tiny refuses an input that requires grad (a forward pre-hook, which
the decomposed layer keeps); the model must still compile, and train equal to eager in pp and dp."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from test_training import adam, assert_same_training

import harmony
from harmony.models import vgg
from harmony.runtime.reference import microbatches_of, reference_train

MINIBATCH = 8


def _refuse_input_gradients(module: torch.nn.Module, args: tuple) -> None:
    if args[0].requires_grad:
        raise RuntimeError("the model's input requires grad")


@pytest.mark.parametrize("mode", ["pp", "dp"])
def test_no_backward_computes_the_gradient_of_the_models_inputs(mode):
    torch.manual_seed(0)
    model = vgg.build_model("tiny", dtype="float64")
    reference = copy.deepcopy(model)
    stem = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    stem.register_forward_pre_hook(_refuse_input_gradients)
    get_batch = functools.partial(vgg.get_batch, preset="tiny", dtype="float64")
    plan = harmony.compile(model, vgg.loss_fn, get_batch, minibatch_size=MINIBATCH, devices=2, mode=mode,
                           build_optimizer=adam, probe=False)
    assert plan.profile.layers[0].at("dx_bytes", 2) == 0  # the profile's trials made no input gradient
    assert plan.profile.layers[1].at("dx_bytes", 2) > 0
    batches = [get_batch(MINIBATCH, step) for step in range(2)]
    with harmony.Trainer(plan, optimizer=adam, timeout=30) as trainer:
        losses = [trainer.step(inputs, target) for inputs, target in batches]
        state = trainer.state_dict()
    expected = reference_train(reference, vgg.loss_fn, adam, batches, microbatches_of(plan.tasks))
    assert_same_training(losses, expected, state, reference.state_dict(), tolerance=1e-9)
