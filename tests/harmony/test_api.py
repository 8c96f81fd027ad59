"""The Python API: compile a live model into a plan, save it, load it back."""

import torch

import harmony


def test_compile_a_live_model_saves_and_loads(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))

    def get_batch(batch_size, step):
        g = torch.Generator().manual_seed(step)
        return torch.randn(batch_size, 8, generator=g), torch.randint(0, 4, (batch_size,), generator=g)

    plan = harmony.compile(model, torch.nn.functional.cross_entropy, get_batch, minibatch_size=8, devices=2,
                           device_memory="64KiB", mode="pp", probe=False)
    assert plan.tasks.mode == "pp" and plan.estimate["fits"]
    assert all(int(peak) <= 64 * 1024 for peak in plan.estimate["peak_memory"].values())
    plan.save(tmp_path / "plan")
    loaded = harmony.load_plan(tmp_path / "plan")
    assert loaded.tasks.to_text() == plan.tasks.to_text()
    assert (tmp_path / "plan" / "trace.json").is_file()
