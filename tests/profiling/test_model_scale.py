"""The compute scale measured on the model's own layers: the runtime's tasks over their estimate, and
the compile's machine carrying it (or the probe's, where it cannot be measured)."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

import harmony.profiling.overheads as overheads
import harmony.profiling.probe as probe
from harmony.compiler import CompileOptions, profile_graph
from harmony.scheduler.machine import nominal_machine
from harmony.decomposer.decompose import decompose
from harmony.errors import HarmonyError

MINIBATCH = 8


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def _get_batch(size: int, step: int):
    gen = torch.Generator().manual_seed(step)
    return (torch.randn(size, 16, generator=gen),), torch.randn(size, 4, generator=gen)


def _loss(output, target):
    return torch.nn.functional.mse_loss(output, target)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.01)


def _profiled(probe_flag: bool = False):
    graph = decompose(_model(), _get_batch(2, 0)[0], depth=1)
    options = CompileOptions(minibatch=MINIBATCH, devices=2, device_memory="1MiB", probe=probe_flag, trials=1,
                             samples=2)
    return graph, options


def test_the_model_scale_is_its_own_layers_on_the_runtime_over_their_estimate():
    graph, options = _profiled()
    profile, machine = profile_graph(graph, _get_batch, _sgd, options, loss_fn=_loss)
    scaling = overheads.measure_model_scale(graph, profile, machine, _get_batch, _loss, _sgd, MINIBATCH,
                                            iterations=2, rounds=1)
    scale, interference = scaling.scale, scaling.interference
    assert scaling.low <= scale <= scaling.high  # the spread of its tasks' readings
    # a ratio of spans, both of the same work: the runtime not free, and finite. These layers compute
    # for microseconds, profiled unwatched, so the runtime's unmodelled costs per task weigh on the
    # scale, which can then read far above 1 on a loaded machine
    assert 0.05 < scale < 100 and 0 <= interference < 20
    assert multiprocessing.active_children() == []


def test_a_probed_compile_carries_the_models_scale(monkeypatch):
    graph, options = _profiled(probe_flag=True)
    nominal = nominal_machine(options.device_type, options.devices, 1 << 20)
    monkeypatch.setattr(probe, "probe_machine", lambda *args, **kwargs: nominal)
    monkeypatch.setattr(overheads, "measure_model_scale",
                        lambda *args, **kwargs: overheads.Scaling(0.77, 0.12, 0.7, 0.9))
    profile, machine = profile_graph(graph, _get_batch, _sgd, options, loss_fn=_loss)
    assert (machine.compute_scale, machine.compute_interference) == (0.77, 0.12) and profile.machine is machine
    assert machine.compute_scale_range == [0.7, 0.9]
    assert "model's own layers" in machine.notes["compute_scale"]


def test_the_probes_scale_stands_where_the_model_cannot_be_run(monkeypatch, caplog):
    graph, options = _profiled(probe_flag=True)
    nominal = nominal_machine(options.device_type, options.devices, 1 << 20)
    monkeypatch.setattr(probe, "probe_machine", lambda *args, **kwargs: nominal)

    def refuse(*args, **kwargs):
        raise HarmonyError("the worker of device 0 failed")

    monkeypatch.setattr(overheads, "measure_model_scale", refuse)
    profile, machine = profile_graph(graph, _get_batch, _sgd, options, loss_fn=_loss)
    assert machine.compute_scale == nominal.compute_scale
    assert "could not be measured" in caplog.text


def test_the_calibration_of_a_large_model_is_cut_to_its_time_budget():
    # a step estimated at 0.1 s keeps two rounds of three iterations; at 1.5 s one round of three;
    # at 10 s one round of one iteration (two steps per device count: a warm-up and the one timed)
    assert overheads._within(8.0, 0.1, 2, 3) == (2, 3)
    assert overheads._within(8.0, 1.5, 2, 3) == (1, 3)
    assert overheads._within(8.0, 10.0, 2, 3) == (1, 1)


def _graph_of(tasks: int):
    """A stand-in task graph: ``tasks`` compute tasks (ids 0..) on device 0."""
    from types import SimpleNamespace

    from harmony.scheduler.tasks import Kind
    return SimpleNamespace(tasks=[SimpleNamespace(id=i, kind=Kind.FWD, device=0) for i in range(tasks)])


def test_the_scale_is_read_on_the_compute_inside_a_span_not_on_the_whole_span():
    # spans of 1 ms compute + 1 ms of modelled overheads, run with the compute at 0.6x: the estimator
    # multiplies compute alone, so the scale it needs is 0.6 (measured / span would say 0.8)
    tasks = _graph_of(3)
    modelled = {i: (2e-3, 1e-3) for i in range(3)}
    measured = {i: 0.6e-3 + 1e-3 for i in range(3)}
    assert abs(overheads._median_ratio(tasks, measured, modelled) - 0.6) < 1e-9


def test_the_scale_and_interference_are_the_median_rounds_not_the_fastest_and_the_range_is_kept():
    # three rounds on one device read 0.5, 0.7, 0.6 and on two 0.9, 0.7, 0.8: a run sees the machine's
    # typical load, so the scale is 0.6 and the interference 0.8 / 0.6 - 1
    tasks = _graph_of(1)
    runs = {1: (tasks, {0: (1.0, 1.0)}), 2: (tasks, {0: (1.0, 1.0)})}
    reads = iter([0.5, 0.9, 0.7, 0.7, 0.6, 0.8])  # the rounds interleave one device and two
    scaling = overheads._scaling(runs, 3, lambda graph: {0: next(reads)}, "a test")
    assert abs(scaling.scale - 0.6) < 1e-9 and abs(scaling.interference - (0.8 / 0.6 - 1)) < 1e-9
    # the one-device rounds' lowest and highest: how much the machine moved while it was measured
    assert (scaling.low, scaling.high) == (0.5, 0.7)
    assert scaling.applied(nominal_machine("cpu", _profiled()[1].devices, 1 << 20)).compute_scale_range == [0.5, 0.7]


def test_the_range_spans_the_models_tasks_not_only_the_rounds():
    # rounds whose medians agree (1.5, 1.55) over tasks that read 1.0 to 3.0: a plan of other tasks
    # lands anywhere between, so the range is the tasks' 10th-90th percentile (eleven readings: the
    # second lowest and the second highest), neither the extremes nor the rounds' spread
    tasks = [1.5, 3.0, 1.2, 1.6, 1.0, 1.4, 1.9, 1.3, 1.5, 1.8, 1.7]
    low, high = overheads._range(tasks, [1.5, 1.55])
    assert (low, high) == pytest.approx((1.2, 1.9))
    assert overheads._range([], [1.5, 1.55]) == (1.5, 1.55)  # no task readings: the rounds'


def test_where_overheads_are_the_whole_span_the_scale_is_read_on_the_spans():
    # modelled overheads of 1.5 ms where the tasks took 1.2 ms in all: a reading on compute would be
    # below zero; the ratio of the spans (1.2 / 2.0) is taken instead
    tasks = _graph_of(3)
    modelled = {i: (2e-3, 0.5e-3) for i in range(3)}
    measured = {i: 1.2e-3 for i in range(3)}
    assert abs(overheads._median_ratio(tasks, measured, modelled) - 0.6) < 1e-9


def test_a_scale_read_on_whole_spans_leaves_out_the_cost_per_task_the_machine_charges_beside_it():
    # as above, with 0.3 ms more on each task that the calibration read as a cost per task: the machine
    # charges that cost on top of the scaled span, so the span's ratio is read without it (1.2 / 2.0)
    tasks = _graph_of(3)
    modelled = {i: (2e-3, 0.5e-3) for i in range(3)}
    measured = {i: 1.2e-3 + 0.3e-3 for i in range(3)}
    assert overheads._task_ratios(tasks, measured, modelled, cost=0.3e-3) == pytest.approx([0.6] * 3)


def _tasks_of(computes: list[float]):
    """A stand-in task graph of FWD tasks (ids 0..) with these computes (s), on device 0, each modelled
    with 0.2 ms of overheads around its compute."""
    from types import SimpleNamespace

    from harmony.scheduler.tasks import Kind
    tasks = SimpleNamespace(tasks=[SimpleNamespace(id=i, kind=Kind.FWD, device=0) for i in range(len(computes))])
    return tasks, {i: (c + 0.2e-3, c) for i, c in enumerate(computes)}


def test_the_models_calibration_reads_a_cost_per_task_beside_the_scale():
    # tasks of 1, 2 and 4 ms of compute that took 1.1x it plus 0.3 ms each (beyond the 0.2 ms modelled):
    # read into one scale, the 1 ms task says 1.4 and the 4 ms one 1.175, so a plan of long tasks
    # comes out high; read as a line, the scale is 1.1 and each task costs 0.3 ms
    computes = [1e-3, 2e-3, 4e-3]
    tasks, modelled = _tasks_of(computes)
    alone = {i: 1.1 * c + 0.2e-3 + 0.3e-3 for i, c in enumerate(computes)}
    together = {i: 1.32 * c + 0.2e-3 + 0.3e-3 for i, c in enumerate(computes)}  # 1.2x as slow on two devices
    runs = {1: (tasks, modelled), 2: (tasks, modelled)}
    reads = iter([alone, together] * 2)
    scaling = overheads._scaling(runs, 2, lambda graph: next(reads), "a test", per_task=True)
    assert scaling.scale == pytest.approx(1.1) and scaling.task == pytest.approx(0.3e-3)
    assert scaling.interference == pytest.approx(0.2)
    assert (scaling.low, scaling.high) == pytest.approx((1.1, 1.1))
    machine = scaling.applied(nominal_machine("cpu", _profiled()[1].devices, 1 << 20))
    assert machine.compute_task_overhead == pytest.approx(0.3e-3) and machine.compute_scale == pytest.approx(1.1)
    # without per_task (the probe's MLP blocks) the same runs fold the cost into the scale
    reads = iter([alone, together] * 2)
    folded = overheads._scaling(runs, 2, lambda graph: next(reads), "a test")
    assert folded.task == 0.0 and folded.scale == pytest.approx(1.1 + 0.3 / 2)


def test_no_cost_per_task_is_read_where_the_tasks_computes_are_alike_or_the_line_says_none():
    # computes within 1.5x of each other cannot tell a cost per task from a scale
    tasks, modelled = _tasks_of([2e-3, 2.2e-3, 2.5e-3])
    assert overheads._task_cost(tasks, {i: 1.1 * c + 0.5e-3 for i, (_, c) in modelled.items()}, modelled) == 0.0
    # a line through the origin or below it: no cost (the scale alone explains the runs)
    tasks, modelled = _tasks_of([1e-3, 2e-3, 4e-3])
    assert overheads._task_cost(tasks, {i: 1.3 * c + 0.2e-3 for i, (_, c) in modelled.items()}, modelled) == 0.0
    assert overheads._task_cost(tasks, {i: 1.3 * c + 0.1e-3 for i, (_, c) in modelled.items()}, modelled) == 0.0
    # fewer than three tasks: no line
    tasks, modelled = _tasks_of([1e-3, 4e-3])
    assert overheads._task_cost(tasks, {i: 1.1 * c + 0.5e-3 for i, (_, c) in modelled.items()}, modelled) == 0.0
