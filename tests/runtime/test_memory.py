"""MemoryTracker counts live storages to the byte, once per storage, and enforces its capacity."""

import pickle
import threading

import pytest
import torch
import torch.nn.functional as F

from harmony.errors import DeviceOutOfMemoryError, HarmonyError
from harmony.runtime.memory import MemoryTracker


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def test_counts_new_tensors_exactly_to_the_byte():
    tr = MemoryTracker(None, "dev0")
    with tr:
        a = torch.empty(100, dtype=torch.float32)
        b = torch.zeros(3, 5, dtype=torch.float64)
        c = torch.ones(7, dtype=torch.int8)
        d = torch.tensor([1.0, 2.0])  # lift_fresh: new memory
    assert tr.current == 400 + 120 + 7 + 8
    assert tr.peak == tr.current
    assert len(tr) == 4
    del a, b, c, d


def test_views_share_the_storage_and_are_not_counted_twice():
    tr = MemoryTracker(None, "dev0")
    with tr:
        a = torch.empty(10, 10)
        views = [a.view(100), a[2:5], a.t(), a.transpose(0, 1).reshape(10, 10).T, a.detach(), a.unsqueeze(0)]
    assert tr.current == 400
    del a
    assert tr.current == 400  # the views keep the storage alive
    views.clear()
    assert tr.current == 0


def test_in_place_ops_allocate_nothing():
    tr = MemoryTracker(None, "dev0")
    with tr:
        a = torch.zeros(64)
        before = tr.current
        a.add_(1).mul_(3).relu_()
        a[3:9].zero_()
    assert tr.current == before == 256


def test_freeing_releases_and_resize_growth_is_counted():
    tr = MemoryTracker(None, "dev0")
    with tr:
        a = torch.empty(10)
        b = torch.empty(20)
        assert tr.current == 120
        del a
        assert tr.current == 80
        b.resize_(50)  # grows the counted storage in place
        assert tr.current == 200
    del b
    assert tr.current == 0
    assert tr.peak == 200


def test_outputs_viewing_uncounted_inputs_are_not_counted():
    w = torch.randn(16, 16)  # made outside: host memory, not the device's
    tr = MemoryTracker(None, "dev0")
    with tr:
        wt = w.t()
        row = w[0]
        y = w @ w
    assert tr.current == y.untyped_storage().nbytes() == 16 * 16 * 4
    del wt, row, y


def test_peak_is_the_high_water_mark_and_resets_to_current():
    tr = MemoryTracker(None, "dev0")
    with tr:
        a = torch.empty(1000, dtype=torch.uint8)
        b = torch.empty(500, dtype=torch.uint8)
        del a
        assert (tr.current, tr.peak) == (500, 1500)
        tr.reset_peak()
        assert tr.peak == 500
        c = torch.empty(200, dtype=torch.uint8)
    assert tr.peak == 700
    del b, c


def test_register_counts_resident_tensors_until_freed_or_unregistered():
    tr = MemoryTracker(None, "dev0")
    p = torch.empty(256)
    q = torch.empty(128)
    tr.register(p)
    tr.register(p[10:])  # same storage: no-op
    tr.register(q)
    assert tr.current == 1024 + 512
    tr.unregister(q)
    assert tr.current == 1024 and not tr.is_tracked(q)
    del q
    assert tr.current == 1024
    del p
    assert tr.current == 0


def test_oom_raised_at_capacity_names_device_request_and_capacity():
    tr = MemoryTracker(1000, "dev3")
    with tr:
        a = torch.empty(200, dtype=torch.uint8)
        b = torch.empty(800, dtype=torch.uint8)  # exactly at capacity: fits
        assert tr.current == 1000
        del b
        with pytest.raises(DeviceOutOfMemoryError) as info:
            torch.empty(801, dtype=torch.uint8)
    err = info.value
    assert isinstance(err, HarmonyError)
    assert (err.device, err.requested, err.current, err.capacity) == ("dev3", 801, 200, 1000)
    msg = str(err)
    assert "dev3" in msg and "801 bytes" in msg and "1000 bytes" in msg and "200 bytes" in msg
    assert "reduce the microbatch size or give the device more memory" in msg
    assert tr.current == 200 and tr.peak == 1000
    # The error travels between worker processes.
    assert str(pickle.loads(pickle.dumps(err))) == msg
    del a


def test_register_past_capacity_is_refused():
    tr = MemoryTracker(100, "dev0")
    with pytest.raises(DeviceOutOfMemoryError):
        tr.register(torch.empty(26))
    assert tr.current == 0


def test_device_left_clean_after_oom_mid_forward():
    model = _mlp()
    x = torch.randn(64, 8)
    tr = MemoryTracker(None, "dev0")
    with tr:
        y = model(x)
    kept, forward_peak = tr.current, tr.peak  # kept: activations saved for backward + output
    del y
    assert tr.current == 0

    # Room for one forward and half of a second one.
    tr = MemoryTracker(max(forward_peak, kept + forward_peak // 2), "dev0")
    with tr:
        y1 = model(x)
        before = tr.current
        tr.reset_peak()
        raised = False
        try:
            model(x)  # runs out part way through the second forward
        except DeviceOutOfMemoryError:
            raised = True
        assert raised
    assert tr.peak > before  # it failed part way, after allocating
    assert tr.current == before
    del y1
    assert tr.current == 0


def test_backward_allocations_are_tracked_when_backward_runs_inside():
    model = _mlp()
    x, target = torch.randn(16, 8), torch.randn(16, 4)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    tr = MemoryTracker(None, "dev0")
    with tr:
        loss = F.mse_loss(model(x), target)
        after_forward = tr.current
        loss.backward()
    # Backward made the gradients (and its temporaries) under the tracker ...
    assert all(tr.is_tracked(p.grad) for p in model.parameters())
    assert tr.peak >= after_forward + param_bytes - 16 * 32 * 4  # at most the ReLU output freed first
    del loss  # ... and freed the graph: what is left is exactly the gradients.
    assert tr.current == param_bytes


def test_backward_called_outside_the_tracker_is_not_tracked():
    model = _mlp()
    tr = MemoryTracker(None, "dev0")
    with tr:
        loss = model(torch.randn(4, 8)).sum()
    loss.backward()  # the autograd engine uses the modes active at the backward() call
    assert not any(tr.is_tracked(p.grad) for p in model.parameters())
    del loss
    assert tr.current == 0


def test_mlp_peak_bounds_saved_activations():
    """Peak >= every activation saved for backward (they are all alive at the end of forward), and
    >= the pre-activation and the ReLU output that coexist while ReLU runs."""
    model = _mlp()
    batch = 32
    x, target = torch.randn(batch, 8), torch.randn(batch, 4)
    tr = MemoryTracker(None, "dev0")
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if tr.is_tracked(t):  # made on the device (not x, target or parameters)
            saved[st._cdata] = st.nbytes()
        return t

    with tr, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.mse_loss(model(x), target)
        after_forward = tr.current
        loss.backward()
    hidden = batch * 32 * 4
    assert sum(saved.values()) >= hidden  # at least the ReLU output, saved by the second Linear
    assert after_forward >= sum(saved.values())
    assert tr.peak >= after_forward
    assert tr.peak >= 2 * hidden + batch * 4 * 4  # pre-activation + ReLU output, then the output
    del loss


def test_threads_count_into_one_total_when_each_enters():
    tr = MemoryTracker(None, "dev0")
    keep = []

    def work():
        with tr:
            keep.append(torch.empty(250))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tr.current == 4 * 1000
    keep.clear()
    assert tr.current == 0


def test_paused_block_is_not_counted_and_nesting_works():
    tr = MemoryTracker(None, "dev0")
    with tr:
        with tr.paused():
            host = torch.empty(100)
        with tr:  # re-entering nests
            a = torch.empty(10)
        b = torch.empty(10)
    c = torch.empty(10)  # after exit: not tracked
    assert tr.current == 80
    del host, a, b, c


def test_an_allocation_past_the_budget_first_lets_memory_about_to_leave_go_then_counts():
    """The plan's peak for a device is a soft limit below its capacity: before an allocation
    passes it, the executor lets outputs still leaving the device go (``over_budget``)."""
    tr = MemoryTracker(10_000, "dev0")
    leaving = []
    calls = []

    def over_budget():
        calls.append(tr.current)
        leaving.clear()  # what the outbound streams held

    tr.budget, tr.over_budget = 4_000, over_budget
    with tr:
        leaving.append(torch.empty(500))  # 2000 bytes on their way out
        kept = torch.empty(250)  # 1000 bytes: within the budget, no call
        assert calls == [] and tr.current == 3_000
        more = torch.empty(500)  # 2000 more would pass 4000: the leaving bytes go first
    assert calls == [3_000]
    assert tr.current == 3_000 and tr.peak == 3_000
    with tr:
        extra = torch.empty(500)  # past the budget with nothing to let go: counted anyway, under capacity
    assert tr.current == 5_000 and calls == [3_000, 3_000]
    del kept, more, extra
