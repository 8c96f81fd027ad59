"""A profile's lookups: columns of a quantity over all layers, fits and their reported errors."""

import random

import pytest

from harmony.profiling.profiles import Fit, LayerProfile, LayerSample, Profile, SAMPLE_FIELDS, fit_samples


def _sample(rng: random.Random, u: int) -> LayerSample:
    return LayerSample(u=u, fwd_time=rng.random() * 1e-3 * u, bwd_time=rng.random() * 2e-3 * u,
                       recompute_time=rng.random() * 1e-3 * u, fwd_peak=rng.randrange(1, 10**9),
                       bwd_peak=rng.randrange(1, 10**9), x_bytes=rng.randrange(10**6) * u, y_bytes=rng.randrange(10**6) * u,
                       dx_bytes=rng.randrange(10**6) * u, act_bytes=rng.randrange(10**7) * u,
                       bwd_first_peak=rng.randrange(10**9))


def _profile(sizes_of_layer) -> Profile:
    rng = random.Random(7)
    layers = []
    for i, sizes in enumerate(sizes_of_layer):
        samples = [_sample(rng, u) for u in sizes]
        rng.shuffle(samples)  # a profile's samples need not be in order of size
        layers.append(LayerProfile(index=i, name=f"L{i}", w_bytes=1000, dw_bytes=1000, k_bytes=2000, b_bytes=0,
                                   upd_time_device=1e-4, upd_time_host=1e-3, fwd_samples=samples,
                                   bwd_samples=samples[:]))
    return Profile(source="measured", device="synthetic", capacity=10**10, u_fmax=max(map(max, sizes_of_layer)),
                   u_bmax=max(map(max, sizes_of_layer)), layers=layers)


@pytest.mark.parametrize("sizes_of_layer", [[(1, 2, 3, 5, 8, 13)] * 6, [(1, 2, 4, 8), (1, 3, 8), (2, 4, 8)]],
                         ids=["one grid", "each layer its own sizes"])
def test_a_column_is_each_layers_own_value_to_the_last_bit(sizes_of_layer):
    """The search reads columns, the estimator single layers: both must say the same, at the samples,
    between them and beyond them."""
    profile = _profile(sizes_of_layer)
    reference = _profile(sizes_of_layer)  # its layers' lookups not warmed by the columns
    one_grid = len(set(sizes_of_layer)) == 1
    assert (profile._grid("fwd_time") is not None) == one_grid  # read for all layers at once, or layer by layer
    for quantity in SAMPLE_FIELDS:
        for u in range(1, 17):
            assert profile.column(quantity, u) == [layer.at(quantity, u) for layer in reference.layers], (quantity, u)


def test_a_columns_sums_match_the_pack_time_of_its_layers():
    profile = _profile([(1, 2, 4, 8)] * 5)
    column = profile.column("bwd_time", 3)
    assert profile.pack_time(1, 3, 3, "bwd_time") == pytest.approx(sum(column[1:4]))


def test_a_packs_backward_counts_the_backward_calls_own_cost_once_not_once_per_layer():
    # each layer's bwd_time, measured alone, carries one backward call's set-up; a BWD task makes one call
    profile = _profile([(1, 2, 4, 8)] * 5)
    profile.backward_call_time = 15e-6
    column = profile.column("bwd_time", 3)
    assert profile.pack_time(1, 3, 3, "bwd_time") == pytest.approx(sum(column[1:4]) - 2 * 15e-6)
    assert profile.pack_time(2, 2, 3, "bwd_time") == pytest.approx(column[2])  # a pack of one layer: its own
    forward = profile.column("fwd_time", 3)
    assert profile.pack_time(1, 3, 3, "fwd_time") == pytest.approx(sum(forward[1:4]))  # the forward composes as it is


def test_a_profile_saved_without_a_backward_call_cost_loads_with_none():
    body = _profile([(1, 2, 4)] * 2).to_dict()
    del body["backward_call_time"]
    assert Profile.from_dict(body).backward_call_time == 0.0


def test_a_profile_with_a_negative_backward_call_cost_is_refused_naming_the_field():
    from harmony.errors import FormatError
    body = _profile([(1, 2, 4)] * 2).to_dict()
    body["backward_call_time"] = -1e-5
    with pytest.raises(FormatError, match="backward_call_time"):
        Profile.from_dict(body)


def test_a_fits_error_is_its_worst_interior_sample_predicted_from_the_others():
    fit = fit_samples([3, 1, 2], [4.0, 1.0, 2.0])  # at 2, the line from 1 to 3 says 2.5: 25% off
    assert fit.us == [1, 2, 3] and fit.ys == [1.0, 2.0, 4.0]
    assert fit.max_rel_error == pytest.approx(0.25)
    assert Fit([1, 2], [1.0, 5.0]).max_rel_error == 0.0  # nothing interior to predict
    assert fit(2.5) == pytest.approx(3.0)
