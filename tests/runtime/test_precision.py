"""Mixed precision: a bf16 plan computes under ``torch.autocast`` on every device and trains as
eager autocast training does (the same microbatches, float32 weights, gradients and Adam state),
on 2 emulated devices below a third of the training footprint, in pp and dp; an fp16 plan also
scales the loss and skips overflowing steps as ``torch.amp.GradScaler`` does (the same tolerance:
fp16 keeps 11 bits, so a flipped rounding weighs less than bf16's).

Tolerance: each microbatch runs the same ops in the same order as the reference, so the two differ
only where gradients add up in another order (across devices, where a value used several times
meets its gradient at a pack boundary, in a clipped gradient's norm): a float32 ulp. A step later a
weight one ulp away can round to the neighbouring bf16 value when autocast casts it (2^-8
relative), and Adam's normalized steps carry that furthest on tensors whose gradients are near zero:
a tensor's largest difference over its scale has reached 1.6e-3 on GPT-2 tiny (and 0.9 on generated
models, ``python -m bench.precision_exactness``), which depends on the plan the search picks. So
weights are compared as the whole model's relative L2 distance, which such stray elements barely
move: 1e-5 allowed (seen: 1e-12 to 2e-8), against 7e-4 to 3e-2 for the same model trained in
float32, which the tests check stays ten times the tolerance. Losses: 1e-5 relative.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import harmony
from harmony.errors import HarmonyError
from harmony.models import gpt2
from harmony.profiling.sweep import training_footprint
from harmony.runtime.reference import microbatches_of, reference_train

MINIBATCH = 8
TOLERANCE = 1e-5  # weights: the whole model's relative L2 distance (module docs)
LOSS_TOLERANCE = 1e-5


def adam(params):
    return torch.optim.Adam(params, lr=1e-3, eps=1e-6)


@functools.lru_cache(maxsize=None)
def model_and_capacity():
    torch.manual_seed(0)
    model = gpt2.build_model("tiny", dtype="float32")
    get_batch = functools.partial(gpt2.get_batch, preset="tiny")
    graph = harmony.decompose(model, get_batch(2, 0)[0])
    return model, get_batch, int(0.3 * training_footprint(graph, get_batch, MINIBATCH))


@functools.lru_cache(maxsize=None)
def plan_at(precision: str, mode: str, clip: float | None = None):
    model, get_batch, capacity = model_and_capacity()
    return harmony.compile(model, gpt2.loss_fn, get_batch, minibatch_size=MINIBATCH, devices=2, mode=mode,
                           device_memory=capacity, build_optimizer=adam, probe=False, precision=precision,
                           clip_grad_norm=clip)


def relative_distance(a: dict, b: dict) -> float:
    """The relative L2 distance of two states over every floating tensor together."""
    keys = [k for k in b if b[k].is_floating_point()]
    return float(sum(((a[k] - b[k]).double() ** 2).sum() for k in keys) ** 0.5
                 / sum((b[k].double() ** 2).sum() for k in keys) ** 0.5)


@pytest.mark.parametrize("mode, clip", [("pp", None), ("dp", None), pytest.param("pp", 0.5, marks=pytest.mark.slow)])
def test_a_bf16_run_equals_eager_autocast_training(mode, clip):
    model, get_batch, _ = model_and_capacity()
    plan = plan_at("bf16", mode, clip)
    assert plan.tasks.precision == "bf16"
    batches = [get_batch(MINIBATCH, step) for step in range(4)]
    with harmony.Trainer(plan, optimizer=adam, timeout=30) as trainer:
        losses = [trainer.step(x, y) for x, y in batches]
        state, history = trainer.state_dict(), trainer.history
    microbatches = microbatches_of(plan.tasks)
    autocast, plain = copy.deepcopy(model), copy.deepcopy(model)
    expected = reference_train(autocast, gpt2.loss_fn, adam, batches, microbatches, precision="bf16",
                               clip_grad_norm=clip)
    reference_train(plain, gpt2.loss_fn, adam, batches, microbatches, clip_grad_norm=clip)
    assert losses == pytest.approx(expected, rel=LOSS_TOLERANCE)
    assert relative_distance(state, autocast.state_dict()) <= TOLERANCE
    # bf16 was used: float32 trains otherwise. The weights show it; the losses need not (with clipping
    # the four losses of some plans' microbatches lie within 1e-5 of float32's)
    assert relative_distance(state, plain.state_dict()) > 10 * TOLERANCE
    assert history[-1].bytes_by_channel() == {k: v for k, v in plan.tasks.bytes_by_channel().items() if v}
    for step in history:
        assert max(w.peak for w in step.workers) <= plan.options["device_memory"]


def test_the_precision_is_part_of_the_saved_plan(tmp_path):
    plan = plan_at("bf16", "pp")
    plan.save(tmp_path / "plan")
    loaded = harmony.load_plan(tmp_path / "plan")
    assert loaded.tasks.precision == "bf16" and loaded.options["precision"] == "bf16"
    assert "precision: bf16 under torch.autocast" in (tmp_path / "plan" / "summary.md").read_text()


def test_an_unknown_precision_is_refused_before_compiling():
    model, get_batch, capacity = model_and_capacity()
    with pytest.raises(HarmonyError, match="unknown precision 'int8'; choose one of fp32, bf16, fp16"):
        harmony.compile(model, gpt2.loss_fn, get_batch, minibatch_size=MINIBATCH, devices=2,
                        device_memory=capacity, probe=False, precision="int8")


FIRST_SCALE = 2.0 ** 20  # high enough that some fp16 gradients overflow: those steps are skipped


@pytest.mark.parametrize("mode, clip", [("pp", None), pytest.param("dp", None, marks=pytest.mark.slow),
                                        pytest.param("pp", 0.5, marks=pytest.mark.slow)])
def test_an_fp16_run_scales_the_loss_and_skips_the_steps_eager_grad_scaler_skips(mode, clip):
    model, get_batch, _ = model_and_capacity()
    plan = plan_at("fp16", mode, clip)
    assert [t for t in plan.tasks.tasks if t.kind.value == "NORM"] and not [t for t in plan.tasks.tasks
                                                                           if t.jit_update()]
    batches = [get_batch(MINIBATCH, step) for step in range(5)]
    with harmony.Trainer(plan, optimizer=adam, timeout=30, loss_scale=FIRST_SCALE) as trainer:
        losses = [trainer.step(x, y) for x, y in batches]
        state, history = trainer.state_dict(), trainer.history
    reference = copy.deepcopy(model)
    scaler_steps: list[float] = []
    expected = reference_train(reference, gpt2.loss_fn, adam, batches, microbatches_of(plan.tasks), precision="fp16",
                               clip_grad_norm=clip, loss_scale=FIRST_SCALE, grad_norms=scaler_steps)
    scales = [step.loss_scale for step in history]
    skipped = [step.skipped for step in history]
    assert any(skipped) and not all(skipped), skipped  # both kinds of step
    # GradScaler: halved after a skipped step, kept after a good one (growth comes after 2000)
    assert all(later == (earlier / 2 if skip else earlier) for earlier, later, skip in zip(scales, scales[1:], skipped))
    assert scales[0] == FIRST_SCALE
    assert losses == pytest.approx(expected, rel=LOSS_TOLERANCE)
    assert relative_distance(state, reference.state_dict()) <= TOLERANCE
    for step in history:
        if not step.skipped:  # a skipped step moves less: its updates stop after the check
            assert step.bytes_by_channel() == {k: v for k, v in plan.tasks.bytes_by_channel().items() if v}


def test_a_checkpoint_of_an_fp16_run_resumes_its_loss_scale(tmp_path):
    _, get_batch, _ = model_and_capacity()
    plan = plan_at("fp16", "pp")
    with harmony.Trainer(plan, optimizer=adam, timeout=30, loss_scale=FIRST_SCALE) as trainer:
        for step in range(2):
            trainer.step(*get_batch(MINIBATCH, step))
        scale = trainer.launcher.loss_scale.scale
        path = trainer.save_checkpoint(tmp_path / "fp16.pt")
    assert scale < FIRST_SCALE
    with harmony.Trainer(plan, optimizer=adam, timeout=30) as trainer:
        trainer.load_checkpoint(path)
        assert trainer.launcher.loss_scale.scale == scale
        trainer.step(*get_batch(MINIBATCH, 2))
        assert trainer.history[-1].loss_scale == scale
