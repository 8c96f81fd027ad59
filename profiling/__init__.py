"""Calibration: everything Harmony measures or models before it plans, in one place.

The scheduler plans from numbers; this package is where they come from. A reader looking for
"how long does a layer take, how much memory does it need, how fast is the link" starts here:

- ``sweep.py``: the profiling run over a layer graph (the slow-start search for the largest
  microbatch, layers measured at a few sizes, packs measured whole) and the training footprint.
- ``measure.py``: one layer, pack or optimizer step, measured as the runtime will run it.
- ``profiles.py``: the data the scheduler reads (``Profile``: per-layer samples and their fits).
- ``analytic.py``: the same data from FLOP counts and a device's spec sheet, without running.
- ``attention.py``: attention counted as the target device runs it (a GPU's fused kernel), not as
  the meta tensors the analytic profiler counts on would run it.
- ``casts.py``: which weights a bf16/fp16 plan moves as low-precision copies.
- ``probe.py``: the machine's links (host <-> device, device <-> device), timed on real copies.
- ``overheads.py``: the runtime's own costs (per task, microbatch, update, message), measured on
  the real executor so that the estimator can charge them.

Nothing in ``harmony.runtime`` imports the measuring modules: the runtime runs a plan from the task
IR and the device (it reads a ``Profile``'s numbers only for a plan made without a memory plan),
and calibration drives the runtime, not the other way round.
"""
