"""The weight-offloading program of Beaumont et al. (§6) on chains small enough to solve by hand."""

import math

import pytest

from harmony.scheduler.machine import Machine
from harmony.scheduler.modes import generate
from harmony.scheduler.offload_bound import Chain, chain_of_graph, iteration_bound, link_bound
from harmony.scheduler.tasks import Configuration



def two_layers(compute: float, capacity: int = 2) -> Chain:
    """Two layers of one byte at one byte per second, nothing beside the weights but δw_i in B_i:
    with room for two bytes, B_1 holds w_1 and δw_1 and nothing else, and so does B_0."""
    return Chain.from_activations([compute] * 2, [compute] * 2, [1, 1], [0, 0], capacity, 1.0)


def test_a_chain_that_fits_trains_in_its_compute_time_and_moves_nothing():
    chain = Chain.from_activations([1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [10, 20, 30], [1, 1, 1], 10**6, 5.0)
    time, link = iteration_bound(chain), link_bound(chain)
    assert time.status == "optimal" and time.bound == pytest.approx(18.0)
    assert link.bound == pytest.approx(0.0, abs=1e-9)


def test_without_compute_to_hide_them_the_bound_is_the_copies_time():
    # w_1 must leave after B_1 (written out in B_1's idle, eq. (3)) while w_0 comes back for B_0;
    # w_1 comes back and w_0 goes out during B_0 and F_0, one byte each way: two seconds of copies
    solution = iteration_bound(two_layers(0.0))
    assert solution.bound == pytest.approx(2.0, rel=1e-6)
    assert solution.schedule.after_backward[1] and solution.schedule.after_forward[0]


def test_a_layer_is_never_written_out_during_its_own_backward():
    # one second per operation hides every copy but w_1's write-back after B_1 (eq. (3))
    assert iteration_bound(two_layers(1.0)).bound == pytest.approx(5.0, rel=1e-6)


def test_one_offload_serves_both_prefetches():
    # both layers' weights leave twice per iteration to fit, yet each is written out once
    solution = link_bound(two_layers(1.0))
    schedule = solution.schedule
    assert solution.bound == pytest.approx(2.0, rel=1e-6)
    assert schedule.offloaded_bytes == pytest.approx(2.0, rel=1e-6)
    assert sum(schedule.offloaded) == 2


def test_the_3_partition_instance_of_the_hardness_proof_meets_its_compute_time():
    # Theorem 1's instance for {4, 5, 6, 7, 4, 4}, m = 2, V = 15 (parts {4, 5, 6}, {7, 4, 4}):
    # the proof's schedule has no idle, so the bound is T = 2m; the memory model must read M_k
    # beside the weights on the device for that schedule to fit M_GPU = mV + V
    m, V, xs = 2, 15, [4, 5, 6, 7, 4, 4]
    L = 5 * m
    forward = [0.0] * L
    forward[2 * m - 1] = float(m)
    backward = [1.0 if (i + 1) <= 2 * m and (i + 1) % 2 == 0 else 0.0 for i in range(L)]
    weights = [V if (i + 1) <= 2 * m and (i + 1) % 2 == 1 else 0 for i in range(2 * m)] + xs
    chain = Chain.from_activations(forward, backward, weights, [0] * L, m * V + V, float(V))
    solution = iteration_bound(chain)
    assert solution.status == "optimal"
    assert solution.bound == pytest.approx(2 * m, rel=1e-6)


def test_eq1_keeps_every_activation_until_its_backward():
    chain = Chain.from_activations([1, 1, 1], [1, 1, 1], [5, 6, 7], [1, 2, 3], 100, 1.0)
    assert chain.forward_memory == (1, 3, 6)
    assert chain.backward_memory == (6, 9, 13)


def test_a_solve_cut_short_reports_a_bound_no_higher_than_the_optimum():
    # twelve layers of 10 bytes on a device of 60 at 4 bytes a second: the link binds
    chain = Chain.from_activations([1.0] * 12, [3.0] * 12, [10] * 12, [1] * 12, 60, 4.0)
    for solve in (lambda limit: iteration_bound(chain, limit, tidy=False), lambda limit: link_bound(chain, limit)):
        optimum, cut = solve(5.0), solve(1e-3)
        assert optimum.status == "optimal" and optimum.bound == pytest.approx(optimum.value)
        assert cut.status in ("optimal", "time limit", "lp relaxation", "trivial")
        assert cut.bound <= optimum.bound * (1 + 1e-9)
    assert iteration_bound(chain, tidy=False).bound > chain.compute  # the link binds


def test_an_operation_larger_than_the_device_is_refused_naming_it():
    with pytest.raises(ValueError, match="B1 alone needs 30 bytes"):
        Chain.from_activations([1, 1], [1, 1], [1, 10], [0, 10], 25, 1.0)


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="backward has 1 entries for 2 layers"):
        Chain((1.0, 1.0), (1.0,), (1, 1), (0, 0), (0, 0), 10, 1.0, 1.0)


def test_a_one_device_plan_becomes_a_chain_of_its_own_work(uniform):
    profile = uniform(4, w=1000, t_fwd=1e-3)
    machine = Machine.from_spec("h100", 1)
    graph = generate("pp", profile, Configuration(2, [(0, 1), (2, 3)], 2, [(0, 0), (1, 1), (2, 3)]), 1, 4)
    chain = chain_of_graph(graph, profile, machine, capacity=10**6)
    # layers 0-1: forward at U_F (1 ms a sample), backward recompute and backward (3 ms a sample);
    # the loss pack 2-3: forward recording (1 ms a sample) and backward (2 ms a sample); each
    # backward steps its pack on the device (0.1 ms a layer)
    assert graph.tasks[-1].update == "device"
    assert chain.forward == pytest.approx((4e-3,) * 4)
    assert chain.backward == pytest.approx((12.1e-3, 12.1e-3, 8.1e-3, 8.1e-3))
    assert chain.weights == (1000,) * 4
    assert math.isclose(chain.h2d, machine.h2d)


def test_a_plan_on_two_devices_is_refused(uniform):
    profile = uniform(4)
    graph = generate("pp", profile, Configuration(2, [(0, 1), (2, 3)], 2, [(0, 1), (2, 3)]), 2, 4)
    with pytest.raises(ValueError, match="one device"):
        chain_of_graph(graph, profile, Machine.from_spec("h100", 2), capacity=10**6)
