"""A dp refusal where pp fits names what dp holds that pp does not, the least memory dp fits, and pp."""

import pytest

from harmony.errors import DeviceOutOfMemoryError
from harmony.scheduler.machine import Machine
from harmony.scheduler.refusal import explain_refusal, fits
from harmony.scheduler.search import NoFeasibleConfiguration, search

from test_search import skewed_profile

CAPACITY = 5_000_000  # pp fits two devices of it at minibatch 4; dp's closest configuration needs 5,400,000


@pytest.fixture(scope="module")
def refused():
    profile = skewed_profile(capacity=CAPACITY)
    machine = Machine.from_spec("1080ti", 2)
    with pytest.raises(NoFeasibleConfiguration) as info:
        search(profile, machine, "dp", 2, 4, capacity=CAPACITY)
    refusal = explain_refusal(info.value, "dp", profile, machine, 2, 4, CAPACITY)
    return profile, machine, info.value, refusal


def test_pp_fits_the_capacity_dp_is_refused(refused):
    profile, machine, _, refusal = refused
    assert search(profile, machine, "pp", 2, 4, capacity=CAPACITY).estimate.fits
    assert refusal.pp is not None and refusal.pp.peak <= CAPACITY
    assert f"Mode pp fits this device memory ({CAPACITY:,} bytes per device): use --mode pp" in refusal.describe()


def test_the_refusal_names_what_dp_holds_beside_its_pack_that_pp_does_not(refused):
    _, _, exc, refusal = refused
    s, pp, fmt = exc.shortfall, refusal.pp, DeviceOutOfMemoryError._fmt
    message = refusal.describe()
    assert message.startswith("dp needs more memory per device than pp here: every dp device runs every pack")
    assert f"peaks at {fmt(s.peak)}" in message and f"that pack's own {fmt(s.own)}" in message
    assert f"{fmt(s.peak - s.own)} of the packs run before and after it on the same device" in message
    assert "the previous pack's gradient still leaving for the host reduction" in message
    assert f"pp runs each pack on one device and peaks at {fmt(pp.peak)}" in message
    assert s.peak > CAPACITY >= pp.peak and s.peak - s.own > pp.peak - pp.own  # what dp holds beyond pp


def test_the_refusal_gives_the_least_capacity_the_dp_search_fits(refused):
    profile, machine, exc, refusal = refused
    least = refusal.least
    assert least is not None and CAPACITY < least <= exc.shortfall.needed
    assert f"The dp search fits from {DeviceOutOfMemoryError._fmt(least)} per device" in refusal.describe()
    assert search(profile, machine, "dp", 2, 4, capacity=least).estimate.fits
    assert not fits(profile, machine, "dp", 2, 4, int(0.98 * least))


def test_compile_asks_for_the_least_capacity_with_the_margin_and_explains(refused):
    from harmony.compiler import _memory_that_fits

    _, _, exc, refusal = refused
    text = _memory_that_fits(exc, 0.1, refusal)
    memory = int(text.split("--device-memory ")[1].split(" bytes")[0].replace(",", ""))
    assert int(memory * 0.9) >= refusal.least > int((memory - 1) * 0.9)
    assert text.endswith(refusal.describe()) and "or more). dp needs more memory per device than pp" in text


def test_other_modes_are_not_explained(refused):
    profile, machine, exc, _ = refused
    assert explain_refusal(exc, "pp", profile, machine, 2, 4, CAPACITY) is None
