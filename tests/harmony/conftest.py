"""The CLI's tests run on emulated devices: where a GPU is visible, ``--device`` would otherwise
default to cuda (the CUDA path has its own tests in ``tests/runtime/test_cuda_training.py``).
Shared by every test of the run, since module-scoped fixtures compile plans before any function-scoped patch."""

import pytest

from harmony import cli


@pytest.fixture(scope="session", autouse=True)
def emulated_devices_by_default():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "default_device", lambda: "cpu")
        yield
