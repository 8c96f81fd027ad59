"""The CLI's tests run on emulated devices: where a GPU is visible, ``--device`` would otherwise
default to cuda (the CUDA path has its own tests in ``tests/runtime/test_cuda_training.py``)."""

import pytest

from harmony import cli


@pytest.fixture(autouse=True)
def emulated_devices_by_default(monkeypatch):
    monkeypatch.setattr(cli, "default_device", lambda: "cpu")
