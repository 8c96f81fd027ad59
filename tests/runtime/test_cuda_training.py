"""The CUDA path of the runtime: the same plan semantics on GPUs (skipped without one).

Workers are spawned (CUDA cannot be forked), streams are CUDA streams, and the results must
match eager training on one GPU (gpt2's dropout draws from the CUDA generator), with P2P
messages through shared host memory and over NCCL (``runtime/p2p.py``; the same code runs over
gloo in ``test_p2p_dist.py``). The NCCL cases need two GPUs.
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


def train_on_gpus(mode: str, devices: int, p2p: str = "auto", device_memory: str = "256MiB"):
    """(runtime losses, reference losses, runtime state, reference state, history, plan) of 3
    iterations of gpt2-tiny in float64 on ``devices`` GPUs (every mode swaps the weights in from
    host memory; 256 MiB leaves room for the BLAS workspaces, 64 MiB on Hopper)."""
    torch.manual_seed(0)
    model = gpt2.build_model("tiny", dtype="float64")
    plan = harmony.compile(model, gpt2.loss_fn, get_batch, minibatch_size=8, devices=devices, mode=mode,
                           device_type="cuda", device_memory=device_memory, build_optimizer=gpt2.build_optimizer,
                           probe=False)
    batches = [get_batch(8, step) for step in range(3)]
    with harmony.Trainer(plan, optimizer=gpt2.build_optimizer, timeout=120, p2p=p2p) as trainer:
        losses = [trainer.step(*batch) for batch in batches]
        state = trainer.state_dict()
        history = trainer.history
    # the reference trains on the GPU too: dropout's masks come from the CUDA generator there
    reference = copy.deepcopy(model).cuda()
    on_gpu = [(x.cuda(), y.cuda()) for x, y in batches]
    expected = reference_train(reference, gpt2.loss_fn, gpt2.build_optimizer, on_gpu, microbatches_of(plan.tasks))
    return losses, expected, state, {k: v.cpu() for k, v in reference.state_dict().items()}, history, plan


@pytest.mark.parametrize("mode", ["pp", "dp"])
def test_cuda_training_matches_eager_reference(mode):
    """P2P messages through shared host memory (the default on GPUs is NCCL: tested below)."""
    losses, expected, state, reference, _, _ = train_on_gpus(mode, min(2, torch.cuda.device_count()), p2p="shm")
    assert losses == pytest.approx(expected, rel=1e-7)
    for name, want in reference.items():
        assert torch.allclose(state[name], want, rtol=1e-6, atol=1e-9), name


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="P2P needs two GPUs")
@pytest.mark.parametrize("mode", ["pp", "1f1b-swap"])
def test_cuda_training_over_nccl_matches_eager_reference_and_moves_the_planned_bytes(mode):
    losses, expected, state, reference, history, plan = train_on_gpus(mode, torch.cuda.device_count(), p2p="dist")
    assert plan.tasks.bytes_by_channel().get("P2P in"), "the plan sends no P2P message"
    assert losses == pytest.approx(expected, rel=1e-7)
    for name, want in reference.items():
        assert torch.allclose(state[name], want, rtol=1e-6, atol=1e-9), name
    assert history[-1].bytes_by_channel() == {k: v for k, v in plan.tasks.bytes_by_channel().items() if v}


@pytest.mark.parametrize("mode", ["pp", "gpipe-swap"])
def test_workers_sharing_a_gpu_train_as_eager_does_and_move_the_planned_bytes(mode, monkeypatch):
    """Four workers on however many GPUs there are (HARMONY_SHARE_GPUS): P2P through host memory,
    since NCCL cannot link two workers on one GPU."""
    monkeypatch.setenv("HARMONY_SHARE_GPUS", "1")
    losses, expected, state, reference, history, plan = train_on_gpus(mode, 4)
    assert losses == pytest.approx(expected, rel=1e-7)
    for name, want in reference.items():
        assert torch.allclose(state[name], want, rtol=1e-6, atol=1e-9), name
    assert history[-1].bytes_by_channel() == {k: v for k, v in plan.tasks.bytes_by_channel().items() if v}
    capacity = plan.worker_capacity()
    for step in history:
        assert all(w.peak <= capacity for w in step.workers) and any(w.peak for w in step.workers)


def test_the_blas_workspaces_come_out_of_the_profile_capacity_and_a_worker_keeps_its_plans():
    from harmony.runtime.device import CudaDevice

    given = 256 << 20
    profiled = CudaDevice(0, given)
    kept = profiled.warm_up(within_capacity=True)
    assert kept > 0 and profiled.capacity == given - kept and profiled.allocated() < kept
    worker = CudaDevice(0, profiled.capacity)
    worker.warm_up(within_capacity=False)
    assert worker.capacity == given - kept and worker.reserved == kept


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
