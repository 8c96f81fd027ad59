"""The measured timeline (``runtime/timeline.py``): every task of the plan once, on its device's
compute thread, in plan order and without overlap, with the compute thread's waits for inputs
inside; side-stream copies on their streams; the estimate of the same plan beside it in one
Chrome trace."""

from __future__ import annotations

import pytest
import torch

import harmony
from harmony.models import gpt2
from harmony.runtime.timeline import ESTIMATE_PID_BASE, measured_events, run_trace
from harmony.scheduler.tasks import HOST


def get_batch(batch_size: int, step: int):
    return gpt2.get_batch(batch_size, step, preset="tiny")


@pytest.fixture(scope="module")
def run():
    torch.manual_seed(0)
    model = gpt2.build_model("tiny", dtype="float64")
    plan = harmony.compile(model, gpt2.loss_fn, get_batch, minibatch_size=8, devices=2, mode="pp",
                           build_optimizer=gpt2.build_optimizer, probe=False)
    with harmony.Trainer(plan, optimizer=gpt2.build_optimizer, timeout=60) as trainer:
        for step in range(2):
            trainer.step(*get_batch(8, step))
        return plan, trainer.history[-1]


def test_every_task_runs_once_on_its_devices_compute_thread_in_plan_order_without_overlap(run):
    plan, step = run
    events = measured_events(step)
    for device in {t.device for t in plan.tasks.tasks}:
        compute = [e for e in events if e.device == device and e.stream == "compute"]
        tasks = [e for e in compute if not e.label.startswith("wait: ")]
        assert [e.task for e in tasks] == [t.id for t in plan.tasks.tasks if t.device == device]
        assert all(a.end <= b.start for a, b in zip(tasks, tasks[1:]))
        span = {e.task: e for e in tasks}
        for wait in (e for e in compute if e.label.startswith("wait: ")):  # inside its task's span
            assert span[wait.task].start <= wait.start <= wait.end <= span[wait.task].end, wait
    assert min(e.start for e in events) == 0 and all(e.end >= e.start for e in events)
    assert max(e.end for e in events) <= step.seconds


def test_side_stream_copies_are_on_their_streams_serving_a_task_of_their_device(run):
    plan, step = run
    events = measured_events(step)
    by_id = {t.id: t for t in plan.tasks.tasks}
    side = [e for e in events if e.stream != "compute"]
    assert {"swap-in", "swap-out", "p2p-in", "p2p-out"} <= {e.stream for e in side}  # a pp plan on 2 devices
    for e in side:
        assert by_id[e.task].device == e.device, e
    assert all(e.device != HOST for e in side)


def test_the_trace_shows_the_measured_timeline_above_the_estimate_of_the_same_plan(run):
    plan, step = run
    trace = run_trace(plan, step)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    measured = {pid for pid, name in names.items() if name.endswith(" measured")}
    estimated = {pid for pid, name in names.items() if name.endswith(" estimated")}
    assert measured and estimated and max(measured) < min(estimated)
    assert {pid - ESTIMATE_PID_BASE for pid in estimated} == measured
    spans = [e for e in trace if e["ph"] == "X"]
    on = {pid: {e["args"]["task"] for e in spans if e["pid"] == pid and e["tid"] == 0} for pid in names}
    for pid in measured:  # the same tasks on each compute thread (the estimate: one span per microbatch)
        assert on[pid] == on[pid + ESTIMATE_PID_BASE]
