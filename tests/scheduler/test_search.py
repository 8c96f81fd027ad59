"""Configuration search: close to brute force on small instances, clear failure when nothing fits."""

import itertools

import pytest

from harmony.scheduler.estimator import estimate
from harmony.scheduler.machine import Machine
from harmony.scheduler.packing import all_contiguous_packings
from harmony.profiling.profiles import LayerProfile, LayerSample, Profile
from harmony.scheduler.search import NoFeasibleConfiguration, every_size, ladder, search
from harmony.scheduler.modes import generate
from harmony.scheduler.tasks import Configuration


def skewed_profile(times=(1.0, 3.0, 1.0, 2.0, 1.5), w=400_000, x=200_000, capacity=8_000_000) -> Profile:
    """Layers of unequal time and size, so that packing and microbatch size matter."""
    layers = []
    for i, t in enumerate(times):
        def sample(u, t=t, i=i):
            wi = w * (1 + i % 2)
            return LayerSample(u=u, fwd_time=1e-3 * t * (0.3 + u), bwd_time=2e-3 * t * (0.3 + u),
                               recompute_time=1e-3 * t * (0.3 + u), fwd_peak=2 * wi + 3 * x * u,
                               bwd_peak=4 * wi + 6 * x * u, x_bytes=x * u, y_bytes=x * u, dx_bytes=x * u, act_bytes=2 * x * u)
        layers.append(LayerProfile(index=i, name=f"L{i}", w_bytes=w * (1 + i % 2), dw_bytes=w * (1 + i % 2),
                                   k_bytes=2 * w * (1 + i % 2), b_bytes=0, upd_time_device=1e-4, upd_time_host=1e-3,
                                   fwd_samples=[sample(1), sample(8)], bwd_samples=[sample(1), sample(8)]))
    return Profile(source="measured", device="synthetic", capacity=capacity, u_fmax=8, u_bmax=8, layers=layers)


def brute_force(profile, machine, mode, devices, minibatch, sizes):
    """The best estimate over every contiguous packing of both passes and every size."""
    r = len(profile.layers)
    best = float("inf")
    for p_b in all_contiguous_packings(r):
        for p_f in all_contiguous_packings(r):
            if p_f[-1] != p_b[-1]:
                continue
            for u_f, u_b in itertools.product(sizes, sizes):
                for update in ("device", "host"):
                    graph = generate(mode, profile, Configuration(u_f, list(p_f), u_b, list(p_b)), devices, minibatch, update=update)
                    est = estimate(graph, profile, machine, capacity=profile.capacity, record_events=False)
                    if est.fits and not est.deadlock:
                        best = min(best, est.iteration_time)
    return best


@pytest.mark.parametrize("mode", ["pp", pytest.param("dp", marks=pytest.mark.slow)])
def test_search_is_within_5_percent_of_brute_force(mode):
    profile = skewed_profile()
    machine = Machine.from_spec("1080ti", 2)
    minibatch, sizes = 6, [1, 2, 3, 4, 6]
    best = brute_force(profile, machine, mode, 2, minibatch, sizes)
    found = search(profile, machine, mode, 2, minibatch, sizes=lambda limit: [s for s in sizes if s <= limit])
    assert found.estimate.fits
    assert found.estimate.iteration_time <= 1.05 * best


def test_search_explores_fewer_configurations_than_it_builds():
    profile = skewed_profile(capacity=12_000_000)  # room for the loss task's memory at u=8
    result = search(profile, Machine.from_spec("1080ti", 2), "pp", 2, 8, sizes=every_size)
    assert result.pruned > 0 and result.explored >= 1


def test_ladder_of_sizes_has_small_ratios_and_ends_at_the_limit():
    assert ladder(1) == [1]
    assert ladder(64) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    assert ladder(10)[-1] == 10 and all(b / a <= 2 for a, b in zip(ladder(100), ladder(100)[1:]))


def test_nothing_fits_is_a_clear_error():
    profile = skewed_profile(capacity=500_000)
    with pytest.raises(NoFeasibleConfiguration, match="no pp configuration fits"):
        search(profile, Machine.from_spec("1080ti", 2), "pp", 2, 4, capacity=500_000)


def test_pipeline_baselines_skip_configurations_with_fewer_packs_than_stages():
    profile = skewed_profile(times=(1.0, 2.0, 1.0))
    result = search(profile, Machine.from_spec("1080ti", 3), "gpipe-swap-r", 3, 6)
    assert len(result.config.packs_f) >= 3


@pytest.mark.parametrize("mode", ["gpipe-swap", "1f1b-swap-r"])
def test_a_pipeline_baseline_with_more_devices_than_layers_is_refused_naming_both(mode):
    profile = skewed_profile(times=(1.0, 2.0, 1.0))
    with pytest.raises(NoFeasibleConfiguration, match=f"{mode} runs a pipeline stage .* the model has 3 layers for 4 "
                                                      "devices; use at most 3 devices"):
        search(profile, Machine.from_spec("1080ti", 4), mode, 4, 8)


@pytest.mark.parametrize("mode, capacity", [("dp", 4_500_000), ("pp", 4_500_000)])
def test_nothing_fits_names_the_closest_configuration_and_the_memory_that_fits_it(mode, capacity):
    """The refusal says what the closest configuration needs, and that much memory fits."""
    profile = skewed_profile(capacity=capacity)
    machine = Machine.from_spec("1080ti", 2)
    with pytest.raises(NoFeasibleConfiguration) as info:
        search(profile, machine, mode, 2, 4, capacity=capacity)
    shortfall = info.value.shortfall
    assert shortfall is not None and shortfall.needed > capacity and shortfall.peak > capacity
    message = str(info.value)
    assert f"the closest, {shortfall.config}" in message and f"fits {shortfall.needed:,} bytes per device" in message
    assert f"whose own pack needs {shortfall.own:,}" in message
    fitting = [estimate(generate(mode, profile, shortfall.config, 2, 4, update=u), profile, machine,
                        capacity=shortfall.needed, record_events=False).fits for u in ("device", "host")]
    assert any(fitting)
    assert search(profile, machine, mode, 2, 4, capacity=shortfall.needed).estimate.fits


def test_compile_turns_the_bytes_that_fit_into_device_memory_with_the_margin():
    from harmony.compiler import _memory_that_fits

    profile = skewed_profile(capacity=4_500_000)
    with pytest.raises(NoFeasibleConfiguration) as info:
        search(profile, Machine.from_spec("1080ti", 2), "dp", 2, 4, capacity=4_500_000)
    needed = info.value.shortfall.needed
    text = _memory_that_fits(info.value, 0.1)
    assert f"--device-memory {-(-needed * 10 // 9):,} bytes" in text
    assert _memory_that_fits(NoFeasibleConfiguration("nothing estimated"), 0.1) == ""


def test_where_the_forward_is_one_pack_the_search_says_u_f_equals_u_b():
    """With one device and room for the whole model, the forward is the loss task's pack, run at
    U_B: every U_F estimates the same, and the plan should not read U_F=1 (it once did, for a BERT
    whose forward then looked like sixteen one-sample tasks)."""
    profile = skewed_profile(capacity=1 << 30)
    found = search(profile, Machine.from_spec("1080ti", 1), "pp", 1, 8, keep_candidates=True)
    assert found.config.packs_f == [(0, len(profile.layers) - 1)]
    assert found.config.u_f == found.config.u_b


def test_a_search_freezes_the_heap_it_found_and_leaves_it_as_it_was(monkeypatch):
    """Its collections walk only its own objects; a heap frozen by someone else (the CLI, a
    comparison worker) stays frozen, and an unfrozen one is unfrozen again. The calls are counted,
    not the frozen objects: a frozen object that dies leaves the count, so two counts of the
    same heap may differ by a few."""
    import gc

    profile, machine = skewed_profile(), Machine.from_spec("1080ti", 2)
    frozen_during = []
    real_search = search.__globals__["_search"]
    real_freeze, real_unfreeze = gc.freeze, gc.unfreeze
    calls: list[str] = []

    def spying(*args):
        frozen_during.append(gc.get_freeze_count())
        return real_search(*args)

    monkeypatch.setitem(search.__globals__, "_search", spying)
    monkeypatch.setattr(gc, "freeze", lambda: (calls.append("freeze"), real_freeze())[1])
    monkeypatch.setattr(gc, "unfreeze", lambda: (calls.append("unfreeze"), real_unfreeze())[1])
    was_frozen = gc.get_freeze_count() > 0  # an in-process CLI test before this one froze it
    real_unfreeze()
    try:
        search(profile, machine, "pp", 2, 8)
        assert frozen_during[0] > 0 and gc.get_freeze_count() == 0 and calls == ["freeze", "unfreeze"]
        real_freeze()
        calls.clear()
        search(profile, machine, "pp", 2, 8)
        assert frozen_during[1] > 0 and gc.get_freeze_count() > 0 and calls == []
    finally:
        real_unfreeze()
        if was_frozen:
            real_freeze()


def test_after_freeze_heap_a_search_neither_counts_nor_thaws_the_frozen_heap(monkeypatch):
    """A comparison worker freezes its heap once (``freeze_heap``); its searches must not ask
    ``gc.get_freeze_count()``, which walks every frozen object, nor freeze or unfreeze
    it."""
    import gc

    from harmony.scheduler import search as search_module

    calls: list[str] = []  # the collector's calls, stubbed: the test process's own heap is left as it is
    monkeypatch.setattr(search_module, "_frozen_for_good", False)
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
    monkeypatch.setattr(gc, "get_freeze_count", lambda: calls.append("count") or 1)
    search_module.freeze_heap()
    assert calls == ["freeze"]
    calls.clear()
    search(skewed_profile(), Machine.from_spec("1080ti", 2), "pp", 2, 8)
    assert calls == []


@pytest.mark.parametrize("mode", ["pp", "dp", "gpipe-swap"])
def test_the_winners_timeline_is_the_one_a_fresh_simulation_records(mode):
    """The search labels its winner's recorded spans instead of simulating it again: the same
    events, time and peaks as ``estimate(record_events=True)``."""
    profile, machine = skewed_profile(), Machine.from_spec("1080ti", 2)
    result = search(profile, machine, mode, 2, 8)
    fresh = estimate(result.graph, profile, machine, capacity=profile.capacity, record_events=True)
    assert result.estimate.events and result.estimate.events == fresh.events
    assert (result.estimate.iteration_time, result.estimate.peak_memory) == (fresh.iteration_time, fresh.peak_memory)
    bare = search(profile, machine, mode, 2, 8, timeline=False).estimate
    assert bare.events == [] and bare.recorded is None and bare.iteration_time == fresh.iteration_time


def test_a_simulation_cut_short_has_no_timeline_to_give():
    profile, machine = skewed_profile(), Machine.from_spec("1080ti", 2)
    graph = search(profile, machine, "pp", 2, 8).graph
    cut = estimate(graph, profile, machine, capacity=profile.capacity, record_events=False, beat=1e-9,
                   timeline_later=True)
    assert cut.cut == "slower"
    with pytest.raises(ValueError, match="cut short"):
        cut.with_timeline()


@pytest.mark.parametrize("mode", ["pp", "dp-swap"])
def test_a_simulation_leaves_no_reference_cycles_for_the_collector(mode):
    """Units and transfers refer to each other while they play; once an estimate is made they are
    let go by reference counting, not left for the cyclic collector (whose passes over them, with
    millions of objects in a large search, would slow it)."""
    import gc

    profile, machine = skewed_profile(), Machine.from_spec("1080ti", 2)
    graph = search(profile, machine, mode, 2, 8).graph
    gc.collect()
    gc.disable()
    try:
        for recorded in (True, False):
            estimate(graph, profile, machine, capacity=profile.capacity, record_events=recorded)
        left = gc.collect()
    finally:
        gc.enable()
    assert left < 50, left


@pytest.mark.parametrize("mode,minibatch", [("pp", 9), ("dp", 9), ("gpipe-swap", 7)])
def test_no_microbatch_is_smaller_than_the_fewest_samples_the_model_trains_on(mode, minibatch):
    # BatchNorm trains on no fewer than two samples: not even a minibatch's last, smaller microbatch
    profile = skewed_profile(capacity=12_000_000)
    profile.u_min = 2
    found = search(profile, Machine.from_spec("1080ti", 2), mode, 2, minibatch, capacity=profile.capacity,
                   keep_candidates=True)
    assert found.candidates
    for _, config in found.candidates:
        graph = generate(mode, profile, config, 2, minibatch)
        assert min(u for task in graph.tasks for u in task.microbatches) >= 2, config


def test_a_minibatch_that_cannot_be_cut_into_trainable_microbatches_is_refused_with_the_reason():
    profile = skewed_profile(capacity=12_000_000)
    profile.u_min = 2
    with pytest.raises(NoFeasibleConfiguration, match="no fewer than 2 samples.*1 and 2 samples.*fewer devices"):
        search(profile, Machine.from_spec("1080ti", 2), "dp", 2, 3, capacity=profile.capacity)
