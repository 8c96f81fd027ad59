"""`harmony.Trainer`, the Python API of docs/architecture.md ("Trainer, API, CLI, checkpoints").

One GPT-2 tiny plan (float64, dropout on, 2 emulated devices with less memory than the model's
training footprint) is compiled per module; each test starts its own trainer (workers) on it.
"""

from __future__ import annotations

import copy
import functools
import os
import time

import pytest
import torch
from torch import nn

import harmony
from harmony import plan as plan_module
from harmony.models import gpt2
from harmony.scheduler import lower as lowering
from harmony.runtime.launcher import WorkerError, _stacks_path

MINIBATCH = 8
get_batch = functools.partial(gpt2.get_batch, preset="tiny", dtype="float64")


def adam(params):
    return torch.optim.Adam(params, lr=1e-3, eps=1e-6)


def boom_loss(output, target):
    """A loss function that fails inside the workers (module level: the forked workers have it)."""
    raise ValueError("boom")


@pytest.fixture(scope="module")
def compiled():
    """(initial state_dict of the model, the model, a 2-device plan whose devices hold less than
    the model's training footprint)."""
    torch.manual_seed(0)
    model = gpt2.build_model("tiny", dtype="float64")
    initial = copy.deepcopy(model.state_dict())
    plan = harmony.compile(model, gpt2.loss_fn, get_batch, minibatch_size=MINIBATCH, devices=2,
                           device_memory="1MiB", build_optimizer=adam, probe=False)
    return initial, model, plan


def mlp_batches(size, step):
    g = torch.Generator().manual_seed(step)
    return (torch.randn(size, 4, generator=g, dtype=torch.float64),
            torch.randn(size, 2, generator=g, dtype=torch.float64))


def mse(output, target):  # module level: where a GPU is visible, workers are spawned and get it pickled
    return ((output - target) ** 2).mean()


@pytest.fixture(scope="module")
def other_plan():
    """A plan for a different model (a small MLP)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    return harmony.compile(model, mse, mlp_batches, minibatch_size=MINIBATCH, devices=2, device_memory="64KiB",
                           probe=False)


def assert_states_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape, name
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), f"{name} differs by {(got[name] - tensor).abs().max().item():.3g}"


def test_a_loaded_plan_runs_its_saved_program_without_lowering_and_trains_as_the_compiled_plan(
        compiled, tmp_path, monkeypatch):
    initial, _, plan = compiled
    plan.save(tmp_path / "plan")
    batches = [get_batch(MINIBATCH, step) for step in range(2)]
    with harmony.Trainer(plan, optimizer=adam, loss_fn=gpt2.loss_fn, state_dict=initial, seed=3) as trainer:
        expected = [trainer.step(*batch) for batch in batches]
    loaded = harmony.load_plan(tmp_path / "plan")

    def no_lowering(*args, **kwargs):
        raise AssertionError("a loaded plan was lowered again")

    monkeypatch.setattr(lowering, "lower", no_lowering)
    monkeypatch.setattr(plan_module, "lower", no_lowering)
    with harmony.Trainer(loaded, optimizer=adam, loss_fn=gpt2.loss_fn, state_dict=initial, seed=3) as trainer:
        assert [trainer.step(*batch) for batch in batches] == expected


def test_state_dict_has_the_models_names_including_the_tied_lm_head_and_equals_it_before_any_step(compiled):
    initial, _, plan = compiled
    with harmony.Trainer(plan, optimizer=adam, timeout=60) as trainer:
        state = trainer.state_dict()
    assert "lm_head.weight" in state and "wte.weight" in state
    assert torch.equal(state["lm_head.weight"], state["wte.weight"])
    assert {k: tuple(v.shape) for k, v in state.items()} == {k: tuple(v.shape) for k, v in initial.items()}
    assert_states_equal(state, initial)


def test_state_dict_is_a_copy_that_does_not_alias_the_trainers_weights(compiled):
    initial, _, plan = compiled
    with harmony.Trainer(plan, optimizer=adam, state_dict=initial, timeout=60) as trainer:
        state = trainer.state_dict()
        for tensor in state.values():
            if tensor.is_floating_point():
                tensor.add_(1.0)
        assert_states_equal(trainer.state_dict(), initial)


def test_checkpoint_after_2_steps_resumed_for_2_more_equals_4_uninterrupted_steps(compiled, tmp_path):
    initial, _, plan = compiled
    path = tmp_path / "ckpt.pt"
    batches = [get_batch(MINIBATCH, step) for step in range(4)]
    with harmony.Trainer(plan, optimizer=adam, state_dict=initial, timeout=60) as trainer:
        straight = [trainer.step(*batches[0]), trainer.step(*batches[1])]
        trainer.save_checkpoint(path)
        straight += [trainer.step(*batches[2]), trainer.step(*batches[3])]
        final = trainer.state_dict()
    with harmony.Trainer(plan, optimizer=adam, state_dict=initial, timeout=60) as resumed:
        assert_states_equal(resumed.state_dict(), initial)
        resumed.load_checkpoint(path)
        assert resumed.iteration == 2
        losses = [resumed.step(*batches[2]), resumed.step(*batches[3])]
        state = resumed.state_dict()
    assert losses == straight[2:]
    assert_states_equal(state, final)
    # the run moved the weights: the comparison above is not between two untouched models
    assert not torch.equal(final["h.0.attn.c_attn.weight"], initial["h.0.attn.c_attn.weight"])


def test_save_checkpoint_leaves_no_temporary_file_and_writes_a_complete_checkpoint(compiled, tmp_path):
    initial, _, plan = compiled
    path = tmp_path / "ckpt.pt"
    with harmony.Trainer(plan, optimizer=adam, state_dict=initial, timeout=60) as trainer:
        trainer.step(*get_batch(MINIBATCH, 0))
        assert trainer.save_checkpoint(path) == path
        state = trainer.state_dict()
        trainer.save_checkpoint(path)  # overwriting leaves nothing behind either
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
    body = torch.load(path, weights_only=True)
    assert body["iteration"] == 1
    assert_states_equal(body["model"], state)
    assert body["optimizer"]


def test_load_checkpoint_of_a_garbage_file_raises_harmony_error_naming_the_file(compiled, tmp_path):
    initial, _, plan = compiled
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"this is not a checkpoint\x00\xff" * 10)
    not_a_checkpoint = tmp_path / "tensor.pt"
    torch.save({"a": torch.zeros(2)}, not_a_checkpoint)
    with harmony.Trainer(plan, optimizer=adam, state_dict=initial, timeout=60) as trainer:
        for path in (garbage, not_a_checkpoint, tmp_path / "missing.pt"):
            with pytest.raises(harmony.HarmonyError, match=path.name) as exc:
                trainer.load_checkpoint(path)
            assert str(path) in str(exc.value)
        # a refused file changes nothing
        assert_states_equal(trainer.state_dict(), initial)
        assert trainer.iteration == 0


def test_load_checkpoint_of_another_model_raises_harmony_error_naming_the_file(compiled, other_plan, tmp_path):
    initial, _, plan = compiled
    path = tmp_path / "mlp.pt"
    with harmony.Trainer(other_plan, timeout=60) as other:
        other.save_checkpoint(path)
    with harmony.Trainer(plan, optimizer=adam, state_dict=initial, timeout=60) as trainer:
        with pytest.raises(harmony.HarmonyError) as exc:
            trainer.load_checkpoint(path)
        assert str(path) in str(exc.value)
        assert_states_equal(trainer.state_dict(), initial)


def test_step_with_a_minibatch_of_the_wrong_size_raises_naming_both_sizes(compiled):
    initial, _, plan = compiled
    with harmony.Trainer(plan, optimizer=adam, state_dict=initial, timeout=60) as trainer:
        with pytest.raises(harmony.HarmonyError) as exc:
            trainer.step(*get_batch(4, 0))
        message = str(exc.value)
        assert "8" in message and "4" in message
        # the trainer is still usable and did not count the refused minibatch
        assert trainer.iteration == 0
        loss = trainer.step(*get_batch(MINIBATCH, 0))
        assert loss == loss and loss > 0


def test_leaving_the_with_block_stops_every_worker_and_step_after_close_raises(compiled):
    initial, _, plan = compiled
    with harmony.Trainer(plan, optimizer=adam, state_dict=initial, timeout=60) as trainer:
        processes = list(trainer.launcher.processes)
        assert len(processes) == 2 and all(p.is_alive() for p in processes)
        trainer.step(*get_batch(MINIBATCH, 0))
    assert not any(p.is_alive() for p in processes)
    with pytest.raises(harmony.HarmonyError):
        trainer.step(*get_batch(MINIBATCH, 1))
    trainer.close()  # closing twice is harmless


def test_the_trainers_process_computes_on_one_thread_while_emulated_devices_run_and_gets_its_threads_back(compiled):
    """The workers have the cores: a parallel op in this process (the minibatch copied into their
    slots) would leave an OpenMP team spin-waiting on a core they need."""
    initial, _, plan = compiled
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with harmony.Trainer(plan, optimizer=adam, state_dict=initial, timeout=60) as trainer:
            assert torch.get_num_threads() == 1
            trainer.step(*get_batch(MINIBATCH, 0))
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_clean_close_leaves_no_worker_files_in_the_temporary_directory(compiled):
    initial, _, plan = compiled
    with harmony.Trainer(plan, optimizer=adam, state_dict=initial, timeout=60) as trainer:
        trainer.step(*get_batch(MINIBATCH, 0))
        pids = [p.pid for p in trainer.launcher.processes]
    left = [path for path in map(_stacks_path, pids) if os.path.exists(path)]
    assert not left, f"left behind: {left}"


def test_close_stops_every_worker(compiled):
    initial, _, plan = compiled
    trainer = harmony.Trainer(plan, optimizer=adam, state_dict=initial, timeout=60)
    processes = list(trainer.launcher.processes)
    trainer.close()
    assert not any(p.is_alive() for p in processes)
    with pytest.raises(harmony.HarmonyError, match="closed"):
        trainer.step(*get_batch(MINIBATCH, 0))


def test_a_loss_function_raising_in_the_workers_raises_worker_error_quickly_and_stops_the_workers(compiled):
    initial, _, plan = compiled
    with harmony.Trainer(plan, optimizer=adam, loss_fn=boom_loss, state_dict=initial, timeout=60) as trainer:
        processes = list(trainer.launcher.processes)
        start = time.monotonic()
        with pytest.raises(WorkerError, match="boom") as exc:
            trainer.step(*get_batch(MINIBATCH, 0))
        elapsed = time.monotonic() - start
        assert elapsed < 30, f"the failure took {elapsed:.1f} s to surface"
        assert "ValueError" in str(exc.value)
        assert not any(p.is_alive() for p in processes)
        with pytest.raises(harmony.HarmonyError):
            trainer.step(*get_batch(MINIBATCH, 0))
