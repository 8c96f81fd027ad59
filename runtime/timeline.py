"""The measured timeline of an iteration, beside the estimated one, as one Chrome trace.

Each worker times what its compute thread runs (a task from its start to its end, waits for inputs
included) and the labelled jobs of its side streams (state and input copies in, outputs and
gradients out, P2P sends); the launcher times the host's tasks. The times are ``time.perf_counter``
seconds, one clock for every process of a host, so the workers' timelines line up; they are shifted
to start at the iteration's first event. The trace puts each device's measured timeline above its
estimate (the compiler's, or ``scheduler.estimator.estimate`` re-run with the plan's own profile
and machine for a plan loaded from disk), with the same streams, so that Perfetto shows where the
run departs from the plan. Not for runs over several hosts, whose clocks differ.
"""

from __future__ import annotations

import logging

from harmony.scheduler.estimator import StreamEvent, estimate, trace_events
from harmony.scheduler.tasks import HOST

from .launcher import StepResult

log = logging.getLogger(__name__)

ESTIMATE_PID_BASE = 1000  # estimated device d is process 1000 + d, below the measured ones


def measured_events(step: StepResult) -> list[StreamEvent]:
    """One iteration's timed work on every device and the host, from its first event on."""
    raw = [(rank, *event) for rank, worker in enumerate(step.workers) for event in worker.events]
    raw += [(HOST, "compute", *event) for event in step.host_events]
    if not raw:
        return []
    origin = min(event[4] for event in raw)
    return [StreamEvent(device, stream, -1 if task is None else task, label, start - origin, end - origin)
            for device, stream, task, label, start, end in sorted(raw, key=lambda e: e[4])]


def run_trace(plan, step: StepResult) -> dict:
    """The Chrome trace of ``step`` measured, and of the plan's estimate of one iteration."""
    events = trace_events(measured_events(step), suffix=" measured")
    estimated = plan.events  # kept by a plan compiled in this process
    machine = plan.profile.machine
    if estimated is None and machine is not None:
        estimated = estimate(plan.tasks, plan.profile, machine, capacity=plan.options.get("planned_memory")).events
    if estimated is not None:
        events += trace_events(estimated, pid_base=ESTIMATE_PID_BASE, suffix=" estimated")
    else:
        log.info("the plan's profile has no machine description: the trace shows the measured timeline only")
    return {"traceEvents": events, "displayTimeUnit": "ms"}
