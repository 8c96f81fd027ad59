"""The loss's own compute: a loss task runs the loss function's forward and backward between its
pack's forward and backward, which no layer's profile times; the profile measures it per size and
the estimator adds it to each loss microbatch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import harmony
from harmony import serialization
from harmony.profiling.profiles import KIND, SCHEMA_VERSION, LayerProfile, LayerSample, LossSample, Profile
from harmony.profiling.sweep import Profiler
from harmony.runtime.device import CpuDevice
from harmony.scheduler.costs import unit_seconds
from harmony.scheduler.machine import Machine
from harmony.scheduler.tasks import Kind, Task

CLASSES = 512  # a wide cross-entropy, so that the loss's time is not lost in the timer's resolution


def _get_batch(batch_size, step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 16, generator=g), torch.randint(0, CLASSES, (batch_size,), generator=g)


def test_the_profile_times_the_loss_function_at_each_size_it_measures():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, CLASSES))
    graph = harmony.decompose(model, _get_batch(2, 0)[0])
    profile = Profiler(graph, _get_batch, lambda p: torch.optim.SGD(p, lr=0.1), CpuDevice("emu", None), trials=2,
                       loss_fn=torch.nn.functional.cross_entropy).profile(u_cap=8, samples=2)
    assert profile.loss_samples and all(s.seconds > 0 for s in profile.loss_samples)
    assert profile.loss_time(profile.loss_samples[-1].u) == profile.loss_samples[-1].seconds


def _profile(loss_samples: list[LossSample], recompute: float = 1e-3) -> Profile:
    samples = [LayerSample(u=u, fwd_time=1e-3 * u, bwd_time=2e-3 * u, recompute_time=recompute * u, fwd_peak=1000,
                           bwd_peak=2000, x_bytes=10 * u, y_bytes=10 * u, dx_bytes=10 * u) for u in (1, 8)]
    layer = LayerProfile(index=0, name="L0", w_bytes=100, dw_bytes=100, k_bytes=0, b_bytes=0, upd_time_device=0.0,
                         upd_time_host=0.0, fwd_samples=samples, bwd_samples=samples)
    return Profile(source="measured", device="test", capacity=1 << 30, u_fmax=8, u_bmax=8, layers=[layer],
                   loss_samples=loss_samples)


def _machine() -> Machine:
    return Machine(kind="cpu", device_name="test", devices=1, capacity=1 << 30, h2d=1e9, d2h=1e9, d2d=1e9,
                   host_link_shared=False, h2d_all=1e9, d2h_all=1e9, msg=1e9, latency=0.0)


def test_a_loss_microbatch_is_estimated_with_the_losss_own_time_and_a_plain_backward_without():
    machine = _machine()
    timed = _profile([LossSample(u=1, nbytes=0, seconds=1e-4), LossSample(u=8, nbytes=0, seconds=8e-4)])
    untimed = _profile([LossSample(u=1, nbytes=0), LossSample(u=8, nbytes=0)])
    loss_task = Task(id=0, device=0, kind=Kind.BWD, first=0, last=0, microbatches=[4, 4], loss=True)
    plain = dataclasses.replace(loss_task, loss=False)
    with_loss, without = unit_seconds(loss_task, timed, machine), unit_seconds(loss_task, untimed, machine)
    # 4e-4 s a microbatch of 4, read off the line through the sizes measured
    assert [a - b for a, b in zip(with_loss, without)] == pytest.approx([4e-4, 4e-4], rel=1e-6)
    assert unit_seconds(plain, timed, machine) == unit_seconds(plain, untimed, machine)


def test_a_loss_microbatchs_forward_is_timed_as_one_recording_for_autograd_not_the_no_grad_forward():
    """A loss task runs its pack's forward with autograd on, as a recompute does (dearer than
    the FWD task's no-grad forward); the estimate takes that time."""
    machine = _machine()
    profile = _profile([LossSample(u=1, nbytes=0), LossSample(u=8, nbytes=0)], recompute=3e-3)
    loss_task = Task(id=0, device=0, kind=Kind.BWD, first=0, last=0, microbatches=[4, 4], loss=True)
    # per microbatch of 4: the recording forward 3e-3 * 4 and the backward 2e-3 * 4 (the no-grad
    # forward, 1e-3 * 4, is not in it)
    assert unit_seconds(loss_task, profile, machine) == pytest.approx([20e-3, 20e-3], rel=1e-9)
    forward = Task(id=1, device=0, kind=Kind.FWD, first=0, last=0, microbatches=[4])
    assert unit_seconds(forward, profile, machine) == pytest.approx([4e-3], rel=1e-9)


def test_a_profile_saved_before_the_loss_was_timed_reads_it_as_unmeasured(tmp_path):
    profile = _profile([LossSample(u=1, nbytes=5, seconds=1e-4)])
    profile.save(tmp_path / "p")
    assert Profile.load(tmp_path / "p").loss_samples[0].seconds == 1e-4
    older = _profile([LossSample(u=1, nbytes=5)])
    body = older.to_dict()
    for sample in body["loss_samples"]:
        del sample["seconds"]
    serialization.save(tmp_path / "old", KIND, SCHEMA_VERSION, body)
    assert Profile.load(tmp_path / "old").loss_time(1) == 0.0
