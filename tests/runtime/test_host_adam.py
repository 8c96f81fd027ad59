"""The host's Adam kernel (``runtime/host_adam.py``): built once per CPU and cached, the same step
whatever the tensors' layout and the thread count, and torch's fused kernel where it cannot be built.
How close its steps come to the optimizer as built is ``test_host_step.py``'s."""

from __future__ import annotations

import shutil

import pytest
import torch

from harmony.runtime import host_adam
from harmony.runtime.host_adam import HostAdam
from harmony.runtime.host_step import fused_twin

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                    reason="needs a C compiler")


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty kernel cache, and the kernel looked up anew (and again after the test)."""
    monkeypatch.setenv("HARMONY_KERNEL_CACHE", str(tmp_path / "kernels"))
    host_adam.kernel.cache_clear()
    yield tmp_path / "kernels"
    host_adam.kernel.cache_clear()


def _adamw(params, **settings):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **settings)


def _step_with(stepper, weight: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    param = torch.nn.Parameter(weight.clone())
    opt = stepper([param])
    for g in grads:
        param.grad = g.clone()
        opt.step()
    return param.detach()


@needs_compiler
def test_the_kernel_is_built_once_into_the_cache_and_loaded_from_it(fresh_cache):
    assert host_adam.kernel() is not None
    built = list(fresh_cache.glob("host_adam-*.so"))
    assert len(built) == 1 and not list(fresh_cache.glob("*.part"))
    stamp = built[0].stat().st_mtime_ns
    host_adam.kernel.cache_clear()
    assert host_adam.kernel() is not None
    assert list(fresh_cache.glob("host_adam-*.so")) == built and built[0].stat().st_mtime_ns == stamp


@needs_compiler
def test_a_tensor_split_over_threads_steps_bitwise_as_on_one_thread():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(300_001, generator=g)
    grads = [torch.randn(300_001, generator=g) for _ in range(3)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _step_with(lambda ps: HostAdam.twin_of(_adamw(ps)), weight, grads)
        torch.set_num_threads(4)
        four = _step_with(lambda ps: HostAdam.twin_of(_adamw(ps)), weight, grads)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, four)


@needs_compiler
def test_a_strided_weight_and_gradient_step_as_contiguous_ones():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 30, generator=g)
    grads = [torch.randn(40, 30, generator=g) for _ in range(3)]
    contiguous = _step_with(lambda ps: HostAdam.twin_of(_adamw(ps)), weight, grads)
    param = torch.nn.Parameter(weight.t().contiguous().t())  # the same values, column-major
    opt = HostAdam.twin_of(_adamw([param]))
    for grad in grads:
        param.grad = grad.t().contiguous().t()
        opt.step()
    assert not param.is_contiguous()
    assert torch.equal(param.detach(), contiguous)
    assert not opt.state[param]["exp_avg"].is_contiguous()  # the state keeps the weight's layout


@needs_compiler
def test_host_adams_state_is_torchs_so_either_can_go_on_from_the_other():
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(64, generator=g)
    grads = [torch.randn(64, generator=g) for _ in range(6)]
    param = torch.nn.Parameter(weight.clone())
    ours = HostAdam.twin_of(_adamw([param]))
    for grad in grads[:3]:
        param.grad = grad.clone()
        ours.step()
    theirs = _adamw([param])
    theirs.state[param] = ours.state[param]
    for grad in grads[3:]:
        param.grad = grad.clone()
        theirs.step()
    reference = _step_with(_adamw, weight, grads)
    assert float(theirs.state[param]["step"]) == 6
    assert torch.allclose(param.detach(), reference, rtol=0, atol=16 * torch.finfo(torch.float32).eps)


def test_without_a_compiler_the_host_steps_adam_with_torchs_fused_kernel(fresh_cache, monkeypatch):
    monkeypatch.setenv("CC", str(fresh_cache / "no-such-compiler"))
    assert host_adam.kernel() is None
    param = torch.nn.Parameter(torch.randn(5))
    param.grad = torch.randn(5)
    twin = fused_twin(_adamw([param]))
    assert type(twin) is torch.optim.AdamW and twin.param_groups[0]["fused"]


@pytest.mark.parametrize("settings, reason", [
    (dict(amsgrad=True), "amsgrad"),
    (dict(lr=torch.tensor(1e-2)), "tensors"),
])
def test_settings_the_kernel_does_not_compute_are_stepped_otherwise(settings, reason):
    param = torch.nn.Parameter(torch.randn(5))
    opt = torch.optim.AdamW([param], **{"lr": 1e-2, **settings})
    assert reason in host_adam.unsupported(opt)
    assert host_adam.unsupported(torch.optim.SGD([param], lr=0.1)) is not None
