"""The profiler: slow-start sweep bounds, memory interpolation, profile files."""

import pytest
import torch

import harmony
from harmony.profiling.sweep import Profiler, _activation_bytes, default_capacity, stride_sizes, training_footprint
from harmony.runtime.device import CpuDevice
from harmony.profiling.profiles import Profile, fit_samples

WIDTH = 32


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH),
        torch.nn.LayerNorm(WIDTH), torch.nn.Linear(WIDTH, 10),
    )


def _get_batch(batch_size, step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, WIDTH, generator=g), torch.randint(0, 10, (batch_size,), generator=g)


def _profiler(capacity, trials=1):
    model = _mlp()
    graph = harmony.decompose(model, _get_batch(2, 0)[0])
    return Profiler(graph, _get_batch, lambda p: torch.optim.SGD(p, lr=0.1), CpuDevice("emu", capacity), trials=trials)


def test_stride_sizes_cover_one_to_max():
    assert stride_sizes(3, 4) == [1, 2, 3]
    sizes = stride_sizes(100, 5)
    assert sizes[0] == 1 and sizes[-1] == 100 and len(sizes) == 5
    assert stride_sizes(9, 1) == [1, 9]


@pytest.mark.parametrize("backward", [False, True])
def test_slow_start_finds_the_largest_microbatch_that_fits(backward):
    profiler = _profiler(capacity=200_000)
    u = profiler.slow_start(backward=backward, cap=10_000)
    fresh = _profiler(capacity=200_000)
    assert fresh.run(u, backward=backward, trials=0).__getattribute__("bwd_fits" if backward else "fwd_fits")
    assert not fresh.run(u + 1, backward=backward, trials=0).__getattribute__("bwd_fits" if backward else "fwd_fits")


def test_backward_maximum_is_below_forward_maximum_and_both_passes_are_sampled_to_their_maximum():
    profile = _profiler(capacity=200_000).profile(u_cap=10_000, samples=3)
    assert profile.u_bmax >= 1 and profile.u_bmax <= profile.u_fmax
    for layer in profile.layers:
        assert [s.u for s in layer.bwd_samples][-1] == profile.u_bmax and len(layer.bwd_samples) >= 3
        assert [s.u for s in layer.fwd_samples][-1] == profile.u_fmax


def test_a_device_too_small_for_one_sample_is_a_clear_error():
    with pytest.raises(harmony.HarmonyError, match=r"layer 0 \(0\+1\) needs [\d,]+ bytes of device memory for one sample"):
        _profiler(capacity=1_000).slow_start(backward=False, cap=8)


def test_interpolated_memory_matches_a_fresh_measurement():
    profiler = _profiler(capacity=None)
    profile = profiler.profile(u_cap=40, samples=3)  # samples at 1, 20, 40
    check = _profiler(capacity=None).run(13, backward=True, trials=0)
    for layer, m in zip(profile.layers, check.fwd):
        assert 13 not in [s.u for s in layer.fwd_samples]
        assert layer.at("fwd_peak", 13) == pytest.approx(m.fwd_peak, rel=0.05)
        assert layer.at("bwd_peak", 13) == pytest.approx(m.bwd_peak, rel=0.05)
        assert layer.at("x_bytes", 13) == pytest.approx(m.x_bytes, rel=0.01)


def test_profile_records_sizes_and_round_trips(tmp_path):
    profile = _profiler(capacity=None).profile(u_cap=8, samples=2)
    first = profile.layers[0]
    assert first.w_bytes == (WIDTH * 4 * WIDTH + 4 * WIDTH) * 4
    assert first.k_bytes == 0  # plain SGD keeps no state
    assert profile.source == "measured"
    profile.save(tmp_path / "profile.msgpack")
    loaded = Profile.load(tmp_path / "profile.msgpack")
    assert loaded.to_dict() == profile.to_dict()


def test_the_backward_call_cost_is_what_the_chain_saves_per_layer_measured_whole_and_never_below_zero(monkeypatch):
    # each layer measured alone carries a backward call's set-up; the chain measured whole carries one
    from harmony.profiling.sweep import CALL_CHAIN
    profiler = _profiler(capacity=None)
    readings = iter([([30e-6] * CALL_CHAIN, 30e-6 * CALL_CHAIN - 14e-6 * (CALL_CHAIN - 1)),
                     ([30e-6] * CALL_CHAIN, 31e-6 * CALL_CHAIN)])  # the second: the whole read slower
    monkeypatch.setattr(profiler, "_chain_backwards", lambda chain, inputs, device: next(readings))
    assert profiler._backward_call_time() == pytest.approx(14e-6)
    assert profiler._backward_call_time() == 0.0
    # a backward that fits nowhere: no cost read, the layers' sum stands
    monkeypatch.setattr(profiler, "_chain_backwards", lambda chain, inputs, device: None)
    assert profiler._backward_call_time() == 0.0


def test_the_backward_call_cost_is_read_on_the_same_cores_where_the_emulated_device_is_too_small_for_its_chain():
    assert _profiler(capacity=16 << 10, trials=3)._backward_call_time() > 0


def test_profiling_leaves_model_buffers_and_rng_untouched():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv1d(4, 4, 1), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5))
    graph = harmony.decompose(model, torch.randn(2, 4, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(7)
    Profiler(graph, lambda b, s: (torch.randn(b, 4, 3, generator=torch.Generator().manual_seed(s)), None), lambda p: torch.optim.SGD(p, lr=0.1),
             CpuDevice("emu", None), trials=1).profile(u_cap=4, samples=2)
    after_rng = torch.rand(1)
    torch.manual_seed(7)
    assert torch.equal(after_rng, torch.rand(1))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_layer_that_fails_for_another_reason_is_named():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    graph = harmony.decompose(model, torch.randn(2, 4))
    profiler = Profiler(graph, lambda b, s: (torch.randn(b, 4), None), lambda p: torch.optim.SGD(p, lr=0.1), CpuDevice("emu", None))
    with pytest.raises(harmony.HarmonyError, match=r"layer 1 \(1\) failed at microbatch size 1: ValueError"):
        profiler.run(1, backward=False, trials=0)


def test_the_training_footprint_of_a_model_that_cannot_train_on_one_sample_is_read_at_two():
    """BatchNorm in train mode refuses one sample; the footprint's per-sample activations are then
    measured on two and halved."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    graph = harmony.decompose(model, torch.randn(2, 4))
    batch = lambda b, s: (torch.randn(b, 4), None)
    activations, peak = _activation_bytes(graph, batch, 2)
    assert training_footprint(graph, batch, 8) == int(4 * graph.parameter_bytes() + 8 * activations / 2)
    # an emulated device given no memory has room for the hungriest layer at the fewest samples
    assert default_capacity(graph, batch, 8) == max(training_footprint(graph, batch, 8) // 4, 2 * peak)


def test_the_training_footprint_names_a_layer_that_fails_at_every_size():
    graph = harmony.decompose(_mlp(), _get_batch(2, 0)[0])
    graph.modules[1].forward = lambda *args: (_ for _ in ()).throw(ValueError("broken layer"))
    with pytest.raises(harmony.HarmonyError, match=r"layer 1 \(.*\) failed at microbatch size 1: ValueError.*--opaque"):
        training_footprint(graph, _get_batch, 8)


def test_the_profile_measures_the_loss_task_the_optimizers_temporaries_and_a_groups_first_microbatch():
    """What a plan needs beyond each layer's forward and backward: the last
    layer's loss task with the loss function, Adam's temporaries, and a group's first microbatch,
    which makes the gradient buffers instead of adding a fresh gradient to them."""
    graph = harmony.decompose(_mlp(), _get_batch(2, 0)[0])
    profile = Profiler(graph, _get_batch, lambda p: torch.optim.Adam(p, lr=1e-3), CpuDevice("emu", None), trials=0,
                       loss_fn=torch.nn.functional.cross_entropy).profile(u_cap=8, samples=2)
    last = profile.layers[-1]
    assert profile.loss_samples and all(s.nbytes > last.at("y_bytes", s.u) for s in profile.loss_samples)
    weighted = [layer for layer in profile.layers if layer.dw_bytes]
    assert all(layer.upd_bytes >= layer.dw_bytes // 4 for layer in weighted)  # Adam's denominator, at least
    assert 0.0 <= profile.update_growth < 0.5  # per tensor on the CPU: the largest layer's, not the sum
    for layer in weighted:
        for s in layer.bwd_samples:
            assert 0 < s.bwd_first_peak < s.bwd_peak, layer.name


def test_a_packs_update_memory_counts_every_parameters_step_counter():
    """Adam keeps a scalar step per parameter, held through every step and never moved as K: a
    pack's update holds all of its layers' (a fused update would otherwise overrun its plan), not
    the largest layer's alone."""
    from harmony.profiling.measure import update_scratch

    graph = harmony.decompose(_mlp(), _get_batch(2, 0)[0])
    adam = lambda p: torch.optim.Adam(p, lr=1e-3)  # noqa: E731
    profile = Profiler(graph, _get_batch, adam, CpuDevice("emu", None), trials=0,
                       loss_fn=torch.nn.functional.cross_entropy).profile(u_cap=2, samples=1)
    params = [p for m in graph.modules for p in m.parameters() if p.requires_grad]
    scratch, scalars = update_scratch(params, adam, CpuDevice("emu", None))
    assert scalars == sum(layer.upd_scalar_bytes for layer in profile.layers) == 4 * len(params)
    assert profile.pack_update_memory(0, len(profile.layers) - 1) >= scratch + scalars


def test_a_layer_whose_update_does_not_fit_the_device_still_has_its_update_temporaries_measured():
    """Its update must go to the host (time inf on the device), but a per-GPU baseline steps it on
    the device anyway: with its temporaries counted as 0 such a plan would promise less than it asks
    for; measured, the plan is refused instead."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 256), torch.nn.Linear(256, 256), torch.nn.Linear(256, 10))
    graph = harmony.decompose(model, _get_batch(2, 0)[0])
    adam = lambda p: torch.optim.Adam(p, lr=1e-3)  # noqa: E731
    big = 256 * 257 * 4
    profile = Profiler(graph, _get_batch, adam, CpuDevice("emu", 7 * big // 2), trials=0).profile(u_cap=2, samples=2)
    layer = next(layer for layer in profile.layers if layer.w_bytes == big)
    assert layer.upd_time_device == float("inf")
    assert layer.upd_bytes >= 256 * 256 * 4 // 4 and layer.upd_scalar_bytes == 2 * 4  # Adam's denominator; 2 steps


def test_a_packs_optimizer_step_is_measured_whole_for_a_plan_and_replaces_the_composition():
    """A pack's update temporaries composed from its layers (the largest layer's, the others' by a
    growth factor) can fall a few bytes short of a run; a plan measures the steps it makes on the
    device whole (PackSample u = 0)."""
    from harmony.profiling.measure import update_scratch

    graph = harmony.decompose(_mlp(), _get_batch(2, 0)[0])
    adam = lambda p: torch.optim.Adam(p, lr=1e-3)  # noqa: E731
    profiler = Profiler(graph, _get_batch, adam, CpuDevice("emu", None), trials=0)
    profile = profiler.profile(u_cap=2, samples=2)
    (sample,) = profiler.measure_packs([(0, 2, 0)])
    params = [p for m in graph.modules[0:3] for p in m.parameters()]
    assert sample.u == 0 and sample.upd_bytes == sum(update_scratch(params, adam, CpuDevice("emu", None)))
    profile.add_packs([sample])
    assert profile.pack_update_memory(0, 2) == sample.upd_bytes


def test_a_fit_extrapolates_noisy_falling_timings_flat_rather_than_to_zero():
    """Two noisy timings of a small layer that fall (0.38 ms at u=2, 0.27 ms at u=3) must not
    extrapolate to no time at u=8: nothing profiled shrinks as the microbatch grows."""
    fit = fit_samples([1, 2, 3], [0.258e-3, 0.38e-3, 0.273e-3])
    assert fit(8) == pytest.approx((0.38e-3 + 0.273e-3) / 2)
    rising = fit_samples([1, 2, 3, 4], [1.0, 2.0, 3.0, 4.0])
    assert rising(8) == pytest.approx(8.0)


def test_host_updates_are_timed_on_host_memory_nobody_watches(monkeypatch):
    """The runtime steps the host store without tracking its ops; a watched device's per-op
    dispatch makes an Adam step several times its run's time."""
    import harmony.profiling.sweep as sweep

    devices = []
    real = sweep.measure_update

    def spy(params, build_optimizer, device, trials=3):
        devices.append(device)
        return real(params, build_optimizer, device, trials)

    monkeypatch.setattr(sweep, "measure_update", spy)
    profiler = _profiler(capacity=200_000)
    profiler.profile(u_cap=4, samples=2)
    hosts = [d for d in devices if d.name == "host"]
    assert hosts and all(not d.measures_memory for d in hosts)
    assert any(d.measures_memory for d in devices if d.name != "host")  # the device's own step stays watched


def test_host_updates_are_timed_with_the_fused_step_a_host_update_runs(monkeypatch):
    """A host update steps torch's SGD by its fused twin (runtime/host_step.py); the profile must
    time that step, not the loop a device runs, or the plan's host updates would be estimated
    several times too long."""
    import harmony.profiling.sweep as sweep

    built = {}
    real = sweep.measure_update

    def spy(params, build_optimizer, device, trials=3):
        if params:
            built.setdefault(device.name, []).append(build_optimizer([torch.nn.Parameter(p.detach().clone())
                                                                       for p in params]))
        return real(params, build_optimizer, device, trials)

    monkeypatch.setattr(sweep, "measure_update", spy)
    _profiler(capacity=200_000).profile(u_cap=4, samples=2)
    assert built["host"] and all(all(g["fused"] for g in opt.param_groups) for opt in built["host"])
    assert not any(g["fused"] for opt in built["emu"] for g in opt.param_groups)


class _Scaled(torch.nn.Module):
    """Two buffers, no parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(WIDTH))
        self.register_buffer("shift", torch.zeros(WIDTH))

    def forward(self, x):
        return x * self.scale + self.shift


def test_the_profile_counts_the_tensors_the_runtime_moves_for_each_layers_state():
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), _Scaled(), torch.nn.Linear(WIDTH, 10))
    model[2].bias.requires_grad_(False)  # frozen: moved in, no gradient, no optimizer state
    graph = harmony.decompose(model, _get_batch(2, 0)[0])
    profiler = Profiler(graph, _get_batch, lambda p: torch.optim.Adam(p, lr=0.1), CpuDevice("emu", 10_000_000), trials=1)
    profile = profiler.profile(u_cap=4, samples=2)
    counts = [(lp.w_tensors, lp.dw_tensors, lp.k_tensors, lp.b_tensors) for lp in profile.layers]
    # Adam's two moments per trainable parameter (its step counter stays on the host)
    assert sum(c[0] for c in counts) == 4 and sum(c[1] for c in counts) == 3
    assert sum(c[2] for c in counts) == 6 and sum(c[3] for c in counts) == 2
    assert profile.state_tensors("W", 0, len(counts) - 1) == 4 and profile.state_tensors("Y", 0, 0) == 0


def _batchnorm_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.BatchNorm1d(WIDTH), torch.nn.ReLU(),
                               torch.nn.Linear(WIDTH, 10))


def test_a_model_that_cannot_train_on_one_sample_is_profiled_from_the_fewest_it_trains_on(caplog):
    # BatchNorm in training needs more than one value per channel: BatchNorm1d on one sample fails
    graph = harmony.decompose(_batchnorm_mlp(), _get_batch(2, 0)[0])
    profiler = Profiler(graph, _get_batch, lambda p: torch.optim.SGD(p, lr=0.1), CpuDevice("emu", 1 << 30), trials=0)
    with caplog.at_level("WARNING"):
        profile = profiler.profile(u_cap=8)
    assert profile.u_min == 2
    assert "cannot train on fewer than 2 samples" in caplog.text and "Expected more than 1 value" in caplog.text
    for layer in profile.layers:
        assert min(s.u for s in layer.fwd_samples + layer.bwd_samples) == 2
    assert Profile.from_dict(profile.to_dict()).u_min == 2
    assert training_footprint(graph, _get_batch, 8) > 0


def test_a_model_that_fails_at_every_size_names_its_layer_and_the_first_size():
    graph = harmony.decompose(_mlp(), _get_batch(2, 0)[0])
    graph.modules[1].forward = lambda *args: (_ for _ in ()).throw(ValueError("broken layer"))
    profiler = Profiler(graph, _get_batch, lambda p: torch.optim.SGD(p, lr=0.1), CpuDevice("emu", 1 << 30), trials=0)
    with pytest.raises(harmony.HarmonyError, match=r"layer 1 \(.*\) failed at microbatch size 1: ValueError: broken layer"):
        profiler.profile(u_cap=4)


def test_an_update_is_timed_on_gradients_of_a_runs_kind_not_zeros():
    """Torch's Adam (its loop on the CPU) steps zero gradients much slower than real ones: timed on
    zeros, a device update read far longer than its run's and the search offloaded updates a
    device would have stepped faster."""
    from harmony.profiling.measure import measure_update

    seen = []

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            seen.append(all(bool(p.grad.abs().sum() > 0) for g in self.param_groups for p in g["params"]))
            return super().step(closure)

    params = [torch.nn.Parameter(torch.ones(8, 8)), torch.nn.Parameter(torch.ones(8))]
    measure_update(params, lambda ps: Recording(ps, lr=0.1), CpuDevice("emu", 1 << 20), trials=2)
    assert seen and all(seen)
