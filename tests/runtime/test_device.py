"""Device backends: the emulated CPU device enforces its capacity and counts real copies; the CUDA
device reports the allocator's numbers and turns CUDA OOM into DeviceOutOfMemoryError; sizes parse."""

import pytest
import torch

from harmony.errors import DeviceOutOfMemoryError
from harmony.runtime.device import (CHECK_MEMORY_ENV, CpuDevice, CudaDevice, Device, UncheckedCpuDevice, cpu_device,
                                   make_devices, memory_checked, parse_bytes)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# ------------------------------------------------------------------ parse_bytes
@pytest.mark.parametrize(
    "text, expected",
    [
        ("1000", 1000),
        ("0", 0),
        ("512B", 512),
        ("8GiB", 8 * 2**30),
        ("512MiB", 512 * 2**20),
        ("4KiB", 4096),
        ("1TiB", 2**40),
        ("1.5GB", 1_500_000_000),
        ("2kb", 2000),
        ("3 MB", 3_000_000),
        (" 0.5 gib ", 2**29),
        ("1e3", 1000),
        (4096, 4096),
    ],
)
def test_parse_bytes_binary_and_decimal_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "8 GiBs", "eight", "-1", "1.5.2GB", "8 Gb/s", "10XB", "1e400GiB", None, -5])
def test_parse_bytes_rejects_bad_text_with_a_clear_message(text):
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes(text)


# ------------------------------------------------------------------ CpuDevice
def test_cpu_device_implements_the_interface():
    dev = CpuDevice("cpu0", 1 << 20)
    assert isinstance(dev, Device)
    assert (dev.name, dev.kind, dev.capacity, dev.torch_device) == ("cpu0", "cpu", 1 << 20, torch.device("cpu"))
    dev.synchronize()
    dev.empty_cache()
    timer = dev.timer()
    timer.start()
    torch.ones(1000).sum()
    assert timer.stop() >= 0.0


def test_cpu_memory_scope_tracks_and_enforces_capacity():
    dev = CpuDevice("cpu1", 4000)
    with dev.memory_scope():
        a = torch.empty(500)  # 2000 bytes
        assert dev.allocated() == 2000
        with pytest.raises(DeviceOutOfMemoryError, match="cpu1"):
            torch.empty(501)
    assert dev.allocated() == 2000 and dev.peak() == 2000
    del a
    assert dev.allocated() == 0
    dev.reset_peak()
    assert dev.peak() == 0


def test_cpu_to_device_copies_count_against_capacity_and_are_released_when_dropped():
    dev = CpuDevice("cpu0", 9_999)
    host = torch.arange(1000, dtype=torch.float32)  # 4000 bytes on the host
    on_dev = dev.to_device(host)
    assert on_dev.data_ptr() != host.data_ptr()  # a real copy ...
    assert torch.equal(on_dev, host)
    assert dev.allocated() == 4000  # ... counted on the device
    assert dev.to_device(on_dev) is on_dev  # already there: no second copy
    second = dev.to_device(host[:500])  # a view copies only its elements
    assert dev.allocated() == 6000
    with pytest.raises(DeviceOutOfMemoryError) as info:
        dev.to_device(host)  # 6000 + 4000 > 9999: refused before copying
    assert info.value.requested == 4000 and info.value.capacity == 9_999
    assert dev.allocated() == 6000
    back = dev.to_host(on_dev)  # the host copy is not device memory
    assert torch.equal(back, host) and back.data_ptr() != on_dev.data_ptr()
    assert dev.allocated() == 6000
    del on_dev, second
    assert dev.allocated() == 0
    assert dev.peak() == 6000


def test_cpu_to_device_inside_scope_counts_once():
    dev = CpuDevice("cpu0", None)
    with dev.memory_scope():
        t = dev.to_device(torch.ones(10, requires_grad=True))
        host = dev.to_host(t, pinned=True)
    assert dev.allocated() == 40
    assert t.requires_grad  # differentiable copy, like Tensor.to
    del t, host
    assert dev.allocated() == 0


def test_cpu_training_step_left_clean_after_oom():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    dev = CpuDevice("cpu0", 64 * 64 * 4)  # one hidden activation of microbatch 64 fits, two don't
    x = torch.randn(256, 16)
    with pytest.raises(DeviceOutOfMemoryError, match="reduce the microbatch size"):
        with dev.memory_scope():
            model(x).sum().backward()
    assert dev.allocated() == 0
    with dev.memory_scope():
        model(x[:8]).sum().backward()
    assert dev.allocated() == sum(p.numel() * 4 for p in model.parameters())


def test_an_unchecked_emulated_device_copies_but_counts_and_refuses_nothing():
    dev = cpu_device("cpu0", 100, check_memory=False)
    assert isinstance(dev, UncheckedCpuDevice) and not dev.measures_memory
    host = torch.ones(1000)  # 4,000 bytes on a 100-byte device: nobody counts
    with dev.memory_scope():
        copy = dev.to_device(host)
        doubled = copy * 2
    assert copy.data_ptr() != host.data_ptr() and torch.equal(doubled, host * 2)
    assert dev.allocated() == dev.peak() == 0
    assert isinstance(cpu_device("cpu0", 100, check_memory=True), CpuDevice)
    assert CpuDevice("cpu0", 100).measures_memory


def test_the_memory_check_is_asked_for_or_read_from_the_environment(monkeypatch):
    monkeypatch.setenv(CHECK_MEMORY_ENV, "1")
    assert memory_checked(None) and not memory_checked(False)
    monkeypatch.setenv(CHECK_MEMORY_ENV, "0")
    assert not memory_checked(None) and memory_checked(True)
    monkeypatch.delenv(CHECK_MEMORY_ENV)
    assert not memory_checked(None)


def test_make_devices():
    devs = make_devices("cpu", 3, parse_bytes("1MiB"))
    assert [d.name for d in devs] == ["cpu0", "cpu1", "cpu2"]
    assert all(d.capacity == 2**20 and d.kind == "cpu" for d in devs)
    assert make_devices("cpu", 1, None)[0].capacity > 0  # host memory
    with pytest.raises(ValueError, match="unknown device kind"):
        make_devices("tpu", 1, None)
    with pytest.raises(ValueError, match="at least one"):
        make_devices("cpu", 0, None)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA devices"):
            make_devices("cuda", 1, None)


def test_more_cuda_workers_than_gpus_need_sharing_asked_for_and_then_talk_through_host_memory(monkeypatch):
    from harmony.errors import HarmonyError
    from harmony.runtime import device, p2p

    monkeypatch.setattr(device, "visible_gpus", lambda: 1)
    monkeypatch.delenv(device.SHARE_GPUS, raising=False)
    device.check_gpus(1)
    with pytest.raises(ValueError, match="asked for 2 CUDA devices but 1 are visible.*HARMONY_SHARE_GPUS=1"):
        device.check_gpus(2)
    assert p2p.resolve("auto", "cuda", 2) == "dist"  # (refused at the devices, not here)
    monkeypatch.setenv(device.SHARE_GPUS, "1")
    device.check_gpus(4)
    assert device.gpus_shared(4) and not device.gpus_shared(1)
    assert p2p.resolve("auto", "cuda", 4) == "shm" and p2p.resolve("auto", "cuda", 1) == "dist"
    with pytest.raises(HarmonyError, match="NCCL cannot link"):
        p2p.resolve("dist", "cuda", 4)
    monkeypatch.setattr(device, "visible_gpus", lambda: 0)
    with pytest.raises(ValueError, match="0 are visible"):  # sharing needs a GPU to share
        device.check_gpus(1)


def test_emulated_devices_have_no_library_workspaces_and_nothing_to_release():
    dev = CpuDevice("cpu0", 1 << 20)
    assert dev.warm_up(within_capacity=True) == 0 and dev.capacity == 1 << 20
    dev.release()


# ------------------------------------------------------------------ CudaDevice
@needs_cuda
def test_cuda_device_memory_numbers_and_timer():
    dev = make_devices("cuda", 1, None)[0]
    assert isinstance(dev, CudaDevice) and dev.kind == "cuda" and dev.capacity > 0
    dev.reset_peak()
    base = dev.allocated()
    with dev.memory_scope():
        t = dev.to_device(torch.ones(1 << 20))
        assert dev.allocated() >= base + (4 << 20)
    assert dev.peak() >= base + (4 << 20)
    host = dev.to_host(t, pinned=True)
    assert host.is_pinned() and torch.equal(host, torch.ones(1 << 20))
    timer = dev.timer()
    timer.start()
    (t @ t).item()
    assert timer.stop() >= 0.0
    del t
    dev.empty_cache()


@needs_cuda
def test_cuda_oom_becomes_device_out_of_memory_error():
    dev = CudaDevice(0)
    with pytest.raises(DeviceOutOfMemoryError, match="cuda:0") as info:
        with dev.memory_scope():
            torch.empty(dev.capacity * 4, dtype=torch.uint8, device=dev.torch_device)
    assert info.value.requested is not None and info.value.requested > dev.capacity
    dev.empty_cache()
