"""The Python API: compile a live model into a plan, save it, load it back."""

import pytest
import torch

import harmony
import harmony.compiler
from harmony.errors import DeviceOutOfMemoryError, HarmonyError


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))


def get_batch(batch_size, step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch_size, 8, generator=g), torch.randint(0, 4, (batch_size,), generator=g)


def test_compile_a_live_model_saves_and_loads(tmp_path):
    model = _model()
    plan = harmony.compile(model, torch.nn.functional.cross_entropy, get_batch, minibatch_size=8, devices=2,
                           device_memory="64KiB", mode="pp", probe=False)
    assert plan.tasks.mode == "pp" and plan.estimate["fits"]
    assert all(int(peak) <= 64 * 1024 for peak in plan.estimate["peak_memory"].values())
    plan.save(tmp_path / "plan")
    loaded = harmony.load_plan(tmp_path / "plan")
    assert loaded.tasks.to_text() == plan.tasks.to_text()
    assert (tmp_path / "plan" / "trace.json").is_file()


def test_an_out_of_memory_the_compile_did_not_catch_names_its_stage_and_asks_for_a_report(monkeypatch):
    """The bare device error would tell the user to shrink the microbatch, though no stage of the
    compile should let one through."""

    def measurer(*args, **kwargs):
        def measure(packs):
            raise DeviceOutOfMemoryError("cuda:0", 32 << 20, 5 << 30, 6 << 30)
        return measure

    monkeypatch.setattr(harmony.compiler, "pack_measurer", measurer)
    with pytest.raises(HarmonyError, match="while measuring the plan's packs .cuda:0: tried to allocate 32.00 MiB") as info:
        harmony.compile(_model(), torch.nn.functional.cross_entropy, get_batch, minibatch_size=8, devices=2,
                        device_memory="64KiB", mode="pp", probe=False)
    assert "harmony -v compile" in str(info.value) and "reduce the microbatch" not in str(info.value)
