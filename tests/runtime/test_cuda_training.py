"""The CUDA path of the runtime: the same plan semantics on GPUs (skipped without one).

Workers are spawned (CUDA cannot be forked), streams are CUDA streams, and the results must
match eager training on the CPU up to the GPU's own rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch

import harmony
from harmony.models import gpt2
from harmony.runtime.reference import microbatches_of, reference_train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def get_batch(batch_size: int, step: int):
    return gpt2.get_batch(batch_size, step, preset="tiny")


@pytest.mark.parametrize("mode", ["pp", "dp"])
def test_cuda_training_matches_eager_reference(mode):
    torch.manual_seed(0)
    model = gpt2.build_model("tiny", dtype="float64")
    devices = min(2, torch.cuda.device_count())
    plan = harmony.compile(model, gpt2.loss_fn, get_batch, minibatch_size=8, devices=devices, mode=mode,
                           device_type="cuda", device_memory="64MiB", build_optimizer=gpt2.build_optimizer,
                           probe=False)
    batches = [get_batch(8, step) for step in range(3)]
    with harmony.Trainer(plan, optimizer=gpt2.build_optimizer, timeout=120) as trainer:
        losses = [trainer.step(*batch) for batch in batches]
        state = trainer.state_dict()
    reference = copy.deepcopy(model)
    expected = reference_train(reference, gpt2.loss_fn, gpt2.build_optimizer, batches, microbatches_of(plan.tasks))
    assert losses == pytest.approx(expected, rel=1e-7)
    for name, want in reference.state_dict().items():
        assert torch.allclose(state[name], want, rtol=1e-6, atol=1e-9), name


def test_pinned_host_regions_make_copies_from_them_asynchronous():
    from harmony.runtime.device import CudaDevice

    device = CudaDevice(0)
    region = torch.zeros(1 << 20, dtype=torch.uint8).share_memory_()
    assert device.pin_host(region)
    view = region[4096:8192]
    assert view.is_pinned() and device._is_pinned(view)
    assert not device._is_pinned(torch.zeros(16))
    out = device.to_device(view)
    torch.cuda.synchronize()
    assert out.is_cuda and out.shape == view.shape
    device.unpin_host()
    assert not device._is_pinned(view)
