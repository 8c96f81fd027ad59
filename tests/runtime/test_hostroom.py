"""Room in shared memory for a run's host store and slabs, checked before anything is mapped: a full
``/dev/shm`` would otherwise kill the process with SIGBUS ("Bus error") and no word of why. A
compile says how much a run of its plan maps, by kind, and that is what the run's store holds."""

import pytest
import torch

import harmony
from harmony.errors import HarmonyError
from harmony.models.gpt2 import GPT, GPTConfig, loss_fn
from harmony.runtime import hostroom
from harmony.runtime.channels import Slabs

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16)


def _batch(size: int, step: int):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, CONFIG.vocab_size, (size, CONFIG.block_size + 1), generator=g)
    return (tokens[:, :-1],), tokens[:, 1:]


def _optimizer(params):
    return torch.optim.Adam(params, lr=1e-3)


@pytest.fixture(scope="module")
def plan():
    """A plan that moves its state every iteration (kept state needs no gradient slots)."""
    torch.manual_seed(0)
    return harmony.compile(GPT(CONFIG), loss_fn, _batch, build_optimizer=_optimizer, minibatch_size=4, devices=2,
                           device_memory="64MiB", compare=False, probe=False, keep_state=False)


def test_check_room_names_a_full_shared_memory_and_what_to_do(monkeypatch):
    monkeypatch.setattr(hostroom, "shared_memory_free", lambda path=hostroom.SHM: 64 << 20)
    with pytest.raises(HarmonyError, match=r"the host store needs 2.00 GiB of shared memory, but /dev/shm has "
                                           r"64.0 MiB free.*--shm-size=3g"):
        hostroom.check_room(2 << 30, "the host store")
    hostroom.check_room(32 << 20, "the host store")  # fits: no error


def test_check_room_names_host_memory_the_kernel_cannot_give(monkeypatch):
    monkeypatch.setattr(hostroom, "shared_memory_free", lambda path=hostroom.SHM: 1 << 40)
    monkeypatch.setattr(hostroom, "available_memory", lambda: 1 << 30)
    with pytest.raises(HarmonyError, match=r"needs 2.00 GiB of host memory, but the kernel reports 1.00 GiB available"):
        hostroom.check_room(2 << 30, "the host store")


def test_check_room_counts_what_a_run_parks_in_host_memory_beside_the_store(monkeypatch):
    monkeypatch.setattr(hostroom, "shared_memory_free", lambda path=hostroom.SHM: 8 << 30)
    monkeypatch.setattr(hostroom, "available_memory", lambda: 3 << 30)
    hostroom.check_room(2 << 30, "a run")  # the store alone fits
    with pytest.raises(HarmonyError, match=r"a run needs 4.00 GiB of host memory \(2.00 GiB of shared memory and "
                                           r"2.00 GiB of activations parked .*recomputes activations parks none"):
        hostroom.check_room(2 << 30, "a run", private=2 << 30)


def test_a_launch_warns_where_the_plan_may_park_more_than_the_host_has(monkeypatch, caplog):
    from harmony.runtime import launcher

    class Parking:
        def parked_bytes(self) -> int:
            return 3 << 30

    monkeypatch.setattr(launcher, "available_memory", lambda: 1 << 30)
    with caplog.at_level("WARNING", logger=launcher.log.name):
        launcher._warn_of_parked(Parking())
    assert "parks up to 3.00 GiB" in caplog.text and "1.00 GiB available" in caplog.text
    monkeypatch.setattr(launcher, "available_memory", lambda: 4 << 30)
    caplog.clear()
    launcher._warn_of_parked(Parking())
    assert not caplog.text


def test_the_machine_readings_are_numbers_where_linux_gives_them():
    assert hostroom.shared_memory_free() > 0 and hostroom.available_memory() > 0
    assert hostroom.shared_memory_free("/no/such/folder") is None


def test_a_run_without_room_for_its_host_store_stops_before_mapping_it_and_starting_workers(plan, monkeypatch):
    monkeypatch.setattr(hostroom, "shared_memory_free", lambda path=hostroom.SHM: 4096)
    started = []
    monkeypatch.setattr("harmony.runtime.launcher.Launcher.__init__", lambda *a, **k: started.append(1))
    with pytest.raises(HarmonyError, match=r"the host store \(weights .*optimizer state .*\) needs .* of shared "
                                           r"memory, but /dev/shm has"):
        harmony.Trainer(plan, optimizer=_optimizer, loss_fn=loss_fn)
    assert not started


def test_message_slabs_are_checked_too(monkeypatch):
    monkeypatch.setattr(hostroom, "shared_memory_free", lambda path=hostroom.SHM: 4096)
    with pytest.raises(HarmonyError, match="the message slabs between 1 pairs of devices needs"):
        Slabs({(0, 1): 1 << 20})


def test_the_compiled_host_memory_is_what_the_runs_store_holds(plan):
    planned = plan.estimate["host_store_bytes"]
    assert planned == sum(plan.estimate["host_store"].values())
    with harmony.Trainer(plan, optimizer=_optimizer, loss_fn=loss_fn) as trainer:
        assert trainer.store.layout.size == planned
        trainer.step(*_batch(4, 0))
    assert "of shared memory for the host store" in plan.summary()


def test_the_plan_says_what_it_parks_in_host_memory_beside_the_store(plan):
    """A pack that swaps its activations parks them in host memory between its forward and its
    backward: the workers' own memory, not the store's."""
    import copy

    from harmony.scheduler.modes import generate
    from harmony.scheduler.tasks import Configuration

    packs = [(0, 0), (1, len(plan.profile.layers) - 1)]
    swapping = copy.copy(plan)
    swapping.tasks = generate("pp", plan.profile, Configuration(2, packs, 2, packs, swap=((0, 0),)), 2, 4)
    parked = swapping.tasks.parked_bytes()
    assert parked > 0
    assert f"up to {hostroom.gib(parked)} of the workers' own for activations parked" in swapping.host_memory_text()


def test_shared_zeros_are_made_in_shared_memory():
    t = hostroom.shared_zeros(1000, torch.float64)
    assert t.is_shared() and t.shape == (1000,) and t.dtype == torch.float64 and not t.any()


def test_the_store_keeps_a_gradient_slot_only_where_a_device_deposits_one(plan):
    """pp: each pack's backward runs on one device, so at most one slot per parameter (two for the
    tied embedding where its packs sit on two devices; none where the device steps the pack itself);
    dp: every device deposits every gradient."""
    torch.manual_seed(0)
    dp = harmony.compile(GPT(CONFIG), loss_fn, _batch, build_optimizer=_optimizer, minibatch_size=4, devices=2,
                         device_memory="64MiB", mode="dp", compare=False, probe=False, keep_state=False)
    for compiled, per_parameter in ((plan, {0, 1, 2}), (dp, {2})):
        slots = compiled.program().gradient_slots(compiled.tasks)
        with harmony.Trainer(compiled, optimizer=_optimizer, loss_fn=loss_fn) as trainer:
            layout = trainer.store.layout
            assert {k for k in layout.entries if k.startswith("G/")} == {f"G/{d}/{n}" for d, n in slots}
            assert {sum(1 for _, n in slots if n == p) for p in layout.params} <= per_parameter
            assert layout.size == compiled.estimate["host_store_bytes"]
            trainer.step(*_batch(4, 0))
    program = plan.program()
    assert len(program.gradient_slots(plan.tasks)) < 2 * len(program.owner)  # fewer than a slot per parameter per device
