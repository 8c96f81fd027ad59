"""Synthetic profiles for scheduler tests: R identical layers with given sizes and times."""

import pytest

from harmony.profiling.profiles import LayerProfile, LayerSample, Profile


def uniform_profile(layers: int = 6, w: int = 1000, x_per_sample: int = 10, t_fwd: float = 1e-3,
                    u_max: int = 64, capacity: int = 10**9) -> Profile:
    """R identical layers: time and activation size linear in u, weights w bytes each."""
    def sample(u):
        return LayerSample(u=u, fwd_time=t_fwd * u, bwd_time=2 * t_fwd * u, recompute_time=t_fwd * u,
                           fwd_peak=2 * w + 3 * x_per_sample * u, bwd_peak=4 * w + 6 * x_per_sample * u,
                           x_bytes=x_per_sample * u, y_bytes=x_per_sample * u, dx_bytes=x_per_sample * u,
                           act_bytes=2 * x_per_sample * u)
    return Profile(
        source="measured", device="synthetic", capacity=capacity, u_fmax=u_max, u_bmax=u_max,
        layers=[LayerProfile(index=i, name=f"L{i}", w_bytes=w, dw_bytes=w, k_bytes=2 * w, b_bytes=0,
                             upd_time_device=1e-4, upd_time_host=1e-3,
                             fwd_samples=[sample(1), sample(u_max)], bwd_samples=[sample(1), sample(u_max)])
                for i in range(layers)],
    )


@pytest.fixture
def uniform():
    return uniform_profile
