"""An offloaded update's step on the host (``runtime/host_step.py``, ``updates.step_on_host``) equals
the user's optimizer stepping copies of the same weights with the same gradients.

Torch's fused CPU kernel orders its arithmetic its own way. Measured over 10 steps of every
setting below, float32 and float64: SGD without momentum is bitwise the loop's; everything else
stays within ``ULPS_PER_STEP`` units in the last place of the tensor's scale per step (measured
at most 3.5 in float64, on Adam with weight decay, and 1.2 in float32, on SGD with momentum).
Optimizers the kernel does not compute exactly step as built, bitwise.
"""

from __future__ import annotations

import pytest
import torch

from harmony.runtime.host_step import fused_twin, host_optimizer, host_step
from harmony.runtime.hoststore import HostStore, Layout, state_layout
from harmony.runtime.lr_schedule import apply as apply_rates
from harmony.runtime.updates import step_on_host

STEPS = 6
ULPS_PER_STEP = 8
SHAPES = ((37, 19), (300,), (3, 5, 7), (1,))

SETTINGS = [
    (torch.optim.Adam, dict(lr=1e-3)),
    (torch.optim.Adam, dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)),
    (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, maximize=True)),
    (torch.optim.AdamW, dict(lr=1e-3)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    (torch.optim.SGD, dict(lr=0.1)),
    (torch.optim.SGD, dict(lr=0.1, weight_decay=1e-2, maximize=True)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1)),
]


def _values(dtype: torch.dtype, seed: int = 0) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Initial weights and ``STEPS`` gradients per weight."""
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s, generator=g).to(dtype) for s in SHAPES]
    grads = [[torch.randn(s, generator=g).to(dtype) for s in SHAPES] for _ in range(STEPS)]
    return weights, grads


def _reference(build, weights: list[torch.Tensor], grads: list[list[torch.Tensor]],
               lrs: list[float] | None = None) -> list[torch.Tensor]:
    """The user's optimizer, built once, stepping copies (eager training)."""
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = build(params)
    for i, step in enumerate(grads):
        for p, g in zip(params, step):
            p.grad = g.clone()
        if lrs is not None:
            for group in opt.param_groups:
                group["lr"] = lrs[i]
        opt.step()
    return [p.detach() for p in params]


def _stepped_on_host(build, weights: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """``host_step`` as an offloaded update calls it: an optimizer built afresh every step over the
    same tensors, the state of the step before handed in."""
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    states: dict = {}
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        states = host_step(build(params), states)
    return [p.detach() for p in params]


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor], bitwise: bool) -> None:
    for a, b in zip(got, want):
        if bitwise:
            assert torch.equal(a, b)
        else:
            bound = ULPS_PER_STEP * STEPS * torch.finfo(b.dtype).eps
            assert float((a - b).abs().max() / b.abs().max()) <= bound


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("cls, settings", SETTINGS, ids=lambda v: v.__name__ if isinstance(v, type) else str(v))
def test_the_fused_host_step_equals_the_optimizer_as_built(cls, settings, dtype):
    def build(params):
        return cls(params, **settings)

    weights, grads = _values(dtype)
    probe = build([torch.nn.Parameter(w.clone()) for w in weights])
    twin = fused_twin(probe)
    assert twin is not None and all(group["fused"] for group in twin.param_groups)
    bitwise = cls is torch.optim.SGD and not settings.get("momentum")
    _assert_close(_stepped_on_host(build, weights, grads), _reference(build, weights, grads), bitwise)


def test_the_fused_twin_keeps_every_group_and_its_settings():
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(3)]
    opt = torch.optim.AdamW([{"params": params[:1], "weight_decay": 0.0, "lr": 0.5},
                             {"params": params[1:], "betas": (0.5, 0.6)}], lr=1e-2, eps=1e-5)
    twin = fused_twin(opt)
    assert len(twin.param_groups) == 2
    for ours, theirs in zip(twin.param_groups, opt.param_groups):
        assert [id(p) for p in ours["params"]] == [id(p) for p in theirs["params"]]
        assert {k: v for k, v in ours.items() if k not in ("params", "fused", "foreach")} == \
               {k: v for k, v in theirs.items() if k not in ("params", "fused", "foreach")}


class _LoggedAdam(torch.optim.Adam):
    """A user's subclass: its step is its own."""

    def step(self, closure=None):
        return super().step(closure)


def _with_hook(params):
    opt = torch.optim.Adam(params, lr=1e-2)
    opt.register_step_post_hook(lambda optimizer, args, kwargs: None)
    return opt


AS_BUILT = {
    "subclass": (lambda params: _LoggedAdam(params, lr=1e-2), torch.float64),
    "fused=False": (lambda params: torch.optim.Adam(params, lr=1e-2, fused=False), torch.float64),
    "step hook": (_with_hook, torch.float64),
    "bfloat16 weights": (lambda params: torch.optim.AdamW(params, lr=1e-2), torch.bfloat16),
    "no fused form": (lambda params: torch.optim.RMSprop(params, lr=1e-2), torch.float64),
}


@pytest.mark.parametrize("case", sorted(AS_BUILT))
def test_an_optimizer_without_an_exact_fused_form_steps_as_built(case):
    build, dtype = AS_BUILT[case]
    weights, grads = _values(dtype)
    assert fused_twin(build([torch.nn.Parameter(w.clone()) for w in weights])) is None
    _assert_close(_stepped_on_host(build, weights, grads), _reference(build, weights, grads), bitwise=True)


def test_a_differentiable_optimizer_has_no_fused_twin():
    params = [torch.nn.Parameter(torch.randn(4, dtype=torch.float64))]
    params[0].grad = torch.randn(4, dtype=torch.float64)
    assert fused_twin(torch.optim.SGD(params, lr=0.1, momentum=0.9, differentiable=True)) is None


def test_momentum_sgd_stepping_some_weights_for_the_first_time_equals_the_optimizer_as_built():
    """The fused kernel takes one first-step flag for a whole group: a weight joining a group whose
    others have momentum already (its first gradient came later) steps by the loop that once."""
    def build(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.3)

    weights, grads = _values(torch.float64)
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    reference = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = build(reference)
    states: dict = {}
    for i, step in enumerate(grads):
        for j, (p, q, g) in enumerate(zip(params, reference, step)):
            late = i == 0 and j == 0  # the first weight has no gradient in the first step
            p.grad = None if late else g.clone()
            q.grad = None if late else g.clone()
        opt.step()
        states = host_step(build(params), states)
    _assert_close([p.detach() for p in params], [q.detach() for q in reference], bitwise=False)


def _store(shapes: dict[str, tuple[int, ...]], build, dtype: torch.dtype) -> HostStore:
    """A host store of one device's gradient slots and ``build``'s state for ``shapes``."""
    layout = Layout(devices=1)
    for name, shape in shapes.items():
        layout.params.append(name)
        layout.add(f"W/{name}", shape, dtype)
        keys = state_layout(torch.empty(shape, dtype=dtype, device="meta"), build)
        layout.state_keys[name] = list(keys)
        for key, (state_shape, state_dtype) in keys.items():
            layout.add(f"K/{name}/{key}", state_shape, state_dtype)
        layout.add(f"G/0/{name}", shape, dtype)
    return HostStore(layout, torch.zeros(layout.size, dtype=torch.uint8),
                     torch.zeros(2 * len(layout.params), dtype=torch.int64))


@pytest.mark.parametrize("default_dtype", [torch.float32, torch.float64])
def test_a_host_update_steps_the_store_in_place_at_the_scheduled_rates(default_dtype):
    """``step_on_host`` over the host store, with two parameter groups and a learning rate that
    changes every step, equals eager AdamW; the state lives in the store's slots (its step counter
    in the user's optimizer's dtype, float64 under a float64 default dtype)."""
    def build(params):
        return torch.optim.AdamW([{"params": params[:2], "weight_decay": 0.0}, {"params": params[2:]}],
                                 lr=1e-2, weight_decay=0.1)

    lrs = [1e-2 * 0.7 ** i for i in range(STEPS)]
    before = torch.get_default_dtype()
    torch.set_default_dtype(default_dtype)
    try:
        weights, grads = _values(torch.float64)
        names = [f"w{i}" for i in range(len(weights))]
        store = _store(dict(zip(names, SHAPES)), build, torch.float64)
        for name, w in zip(names, weights):
            store.weight(name).copy_(w)
        for i, step in enumerate(grads):
            for name, g in zip(names, step):
                store.grad_slot(0, name).copy_(g)
                store.stamp_slot(0, name, i)
            rates = {name: {"lr": lrs[i]} for name in names}
            step_on_host(store, names, build, i, rates)
        want = _reference(build, weights, grads, lrs)
        assert store.state(names[0])["step"].dtype == default_dtype
    finally:
        torch.set_default_dtype(before)
    assert all(float(store.state(name)["step"]) == STEPS for name in names)
    _assert_close([store.weight(name) for name in names], want, bitwise=False)


def test_rates_set_on_the_users_optimizer_reach_the_fused_step():
    params = [torch.nn.Parameter(torch.ones(3, dtype=torch.float64))]
    params[0].grad = torch.ones(3, dtype=torch.float64)
    opt = torch.optim.SGD(params, lr=1.0)
    apply_rates(opt, {"w": params[0]}, {"w": {"lr": 0.25}})
    host_step(opt, {})
    assert torch.equal(params[0].detach(), torch.full((3,), 0.75, dtype=torch.float64))


def test_the_profile_times_the_step_a_host_update_runs():
    """The profiler times a host update with ``host_optimizer``: the fused twin where the host step
    has one, the optimizer as built where it does not."""
    params = [torch.nn.Parameter(torch.randn(5))]
    params[0].grad = torch.randn(5)
    fused = host_optimizer(lambda ps: torch.optim.Adam(ps, lr=1e-3))(params)
    assert type(fused) is torch.optim.Adam and fused.param_groups[0]["fused"]
    loop = host_optimizer(lambda ps: torch.optim.RMSprop(ps, lr=1e-3))(params)
    assert type(loop) is torch.optim.RMSprop
