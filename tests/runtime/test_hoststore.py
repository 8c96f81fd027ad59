"""The host store: the low-precision copies it keeps follow their masters, and seen from a device's
stream threads, looking a slot up must not touch the device.

A swap-out thread runs inside its device's memory tracker. Anything it allocates while finding a
host slot is counted as device memory, and lands on top of whatever the compute thread holds at
that moment: even a ``torch.empty(())`` made there only to read a dtype's element size would take
the device a few bytes over its plan.
"""

import torch

import harmony
from harmony.runtime.hoststore import HostStore, Layout
from harmony.runtime.memory import MemoryTracker


def _store() -> HostStore:
    layout = Layout(devices=2)
    layout.params = ["w"]
    layout.add("W/w", [3, 5], torch.float32)
    layout.add("G/0/w", [3, 5], torch.float32)
    layout.add("K/w/momentum_buffer", [3, 5], torch.float64)
    buffer = torch.zeros(layout.size, dtype=torch.uint8)
    flags = torch.zeros(1 + 2, dtype=torch.int64)
    return HostStore(layout, buffer, flags)


def test_looking_up_host_slots_allocates_nothing_on_the_device():
    store = _store()
    tracker = MemoryTracker(capacity_bytes=1 << 20, device_name="cpu0")
    with tracker:
        slot = store.grad_slot(0, "w")
        weight = store.weight("w")
        state = store.view("K/w/momentum_buffer")
    assert tracker.peak == 0
    assert (slot.shape, slot.dtype) == (torch.Size([3, 5]), torch.float32)
    assert (weight.shape, state.dtype) == (torch.Size([3, 5]), torch.float64)


def test_low_precision_copies_follow_their_masters_as_loaded():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    graph = harmony.decompose(model, (torch.zeros(2, 4),))
    store = HostStore.create(graph, 1, lambda ps: torch.optim.SGD(ps, lr=0.1), model.state_dict(),
                             low_copies={"0.weight": "bfloat16"})
    assert store.low_copy("0.weight").dtype == torch.bfloat16 and store.low_copy("1.weight") is None
    assert torch.equal(store.low_copy("0.weight"), model[0].weight.detach().to(torch.bfloat16))
    store.load_tensors(graph, {k: v + 1 for k, v in model.state_dict().items()})
    assert torch.equal(store.low_copy("0.weight"), (model[0].weight.detach() + 1).to(torch.bfloat16))


def test_entry_bytes_follow_the_dtype():
    layout = Layout()
    layout.add("a", [7], torch.float64)
    layout.add("b", [2, 3], "torch.bfloat16")
    assert layout.entries["a"].nbytes == 56
    assert layout.entries["b"].nbytes == 12


def test_optimizer_state_layout_is_found_without_real_memory_where_the_optimizer_allows():
    from harmony.runtime.hoststore import state_layout

    param = torch.empty(30, 20, device="meta")
    adam = state_layout(param, lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True))
    assert adam == {"step": ([], torch.float32), "exp_avg": ([30, 20], torch.float32),
                    "exp_avg_sq": ([30, 20], torch.float32), "max_exp_avg_sq": ([30, 20], torch.float32)}
    # ASGD reads a value (.item()), which a meta tensor cannot give: stepped on the CPU instead
    asgd = state_layout(param, lambda ps: torch.optim.ASGD(ps, lr=1e-3))
    assert asgd["ax"] == ([30, 20], torch.float32) and set(asgd) == {"step", "eta", "mu", "ax"}
