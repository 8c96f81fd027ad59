"""`harmony.Trainer`: train on a plan as if on one device with unbounded memory (docs/architecture.md, section 7).

    plan = harmony.compile(model, loss_fn, get_batch, minibatch_size=64, devices=4)
    with harmony.Trainer(plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4)) as trainer:
        for step in range(100):
            loss = trainer.step(*get_batch(64, step))

Workers that are not forked (CUDA workers, and emulated ones once a fork could not run a backward
pass: ``runtime/processes.py``) receive the loss function and the optimizer builder pickled with
cloudpickle (so lambdas, closures and a notebook's functions travel by value) and never import the
script that started them: a script needs no ``if __name__ == "__main__":`` guard.

Each ``step`` is one synchronous SGD iteration over the minibatch: the same losses and weights
as eager training of the model on one process with the plan's microbatches (``runtime/reference``).
The trainer owns the worker processes; ``close()`` (or leaving the ``with`` block) stops them.
``p2p`` picks how activations and gradients travel between devices: "shm" (through shared host
memory), "dist" (torch.distributed: NCCL between GPUs, gloo between emulated devices) or "auto"
(torch.distributed on GPUs, shared memory on emulated devices).

``check_memory`` makes emulated devices count every op against their capacity (a dispatch mode,
``runtime/memory.py``): out-of-memory is then raised where it happens, and each step reports the
measured peak per device. Off (the default, unless ``HARMONY_CHECK_MEMORY=1``; the test suite sets
it), a run keeps to the plan's reservations alone (``runtime/ledger.py``), about a fifth faster on
small models, and reports the ledger's peak. GPUs always measure: their allocator counts.

``lr_scheduler`` takes a builder of any ``torch.optim.lr_scheduler`` scheduler from an optimizer
(``lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)``): the scheduler is
stepped once per minibatch, after it, and every update of the minibatch, on a device or on the
host, runs at the rate it gives (``runtime/lr_schedule.py``); checkpoints save and restore it.

A plan may keep packs' weights, buffers and optimizer state on their devices across iterations
(``scheduler/keep.py``): ``state_dict``, ``save_checkpoint`` and ``close`` write them back to the host
store first, ``load_state_dict`` and ``load_checkpoint`` replace them; ``self.store`` is current only
after one of these. If a worker dies, what its device kept since the last write-back is lost, and
those calls say so instead of returning older weights.

``clip_grad_norm`` (default: the plan's) clips the gradient as ``clip_grad_norm_`` before every
step (``runtime/clipping.py``). An fp16 plan scales the loss as ``torch.amp.GradScaler`` does,
starting at ``loss_scale`` (default 2**16), and skips the steps whose gradient overflowed
(``runtime/lossscale.py``); checkpoints save and restore the scale.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import torch

from harmony import checkpoint
from harmony.errors import HarmonyError
from harmony.inputs import LOSS_SIGNATURE, check_callable, check_optimizer_builder, check_scheduler_builder
from harmony.plan import Plan
from harmony.runtime.clipping import check_clipping
from harmony.runtime.context import Batch
from harmony.runtime.hoststore import HostStore
from harmony.modelfile import default_optimizer
from harmony.runtime.launcher import Launcher, StepResult
from harmony.runtime.timed import Timing
from harmony.runtime.lr_schedule import Schedule

log = logging.getLogger(__name__)


def _check_functions(optimizer: Callable | None, loss_fn: Callable | None, lr_scheduler: Callable | None,
                     build_optimizer: Callable) -> None:
    """The functions given to the trainer, checked before any worker starts (``harmony.inputs``): an
    optimizer or scheduler builder that fails would otherwise fail in a worker's first update.
    ``build_optimizer``: the one the run uses, which the scheduler builder is tried with."""
    if loss_fn is not None:
        check_callable(loss_fn, "loss_fn", LOSS_SIGNATURE)
    if optimizer is not None:
        check_optimizer_builder(optimizer, name="optimizer")
    if lr_scheduler is not None:
        check_scheduler_builder(lr_scheduler, build_optimizer)


class Trainer:
    """Runs a plan's task graph on its devices, one minibatch per ``step``. On emulated CPU devices
    this process computes on one torch thread until ``close`` (the workers have the cores; see
    ``runtime.launcher.Launcher``), so work it does between steps runs single-threaded. ``timing``
    makes the emulated devices timed ones (``runtime/timed.py``: their work lasts what the cost
    model says), for measuring the estimate against the run."""

    def __init__(self, plan: Plan, optimizer: Callable | None = None, loss_fn: Callable | None = None,
                 state_dict: dict[str, torch.Tensor] | None = None, seed: int = 0, timeout: float = 600.0,
                 prefetch: bool = True, p2p: str = "auto", check_memory: bool | None = None,
                 lr_scheduler: Callable | None = None, clip_grad_norm: float | None = None,
                 loss_scale: float | None = None, timing: Timing | None = None) -> None:
        self.plan = plan
        # the plan's own threshold unless given: a plan that clips is compiled for it (its updates wait for the norm)
        self.clip_grad_norm = clip_grad_norm if clip_grad_norm is not None else plan.options.get("clip_grad_norm")
        check_clipping(plan.tasks, self.clip_grad_norm)
        self.loss_fn = loss_fn or plan.loss_fn
        if self.loss_fn is None:
            raise HarmonyError("the trainer needs the loss function: pass loss_fn=, or compile the plan with harmony.compile")
        self.build_optimizer = optimizer or plan.build_optimizer or default_optimizer
        _check_functions(optimizer, loss_fn, lr_scheduler, self.build_optimizer)
        self.seed = seed
        self.history: list[StepResult] = []
        graph = plan.graph
        if state_dict is None:
            if graph.modules is None:
                raise HarmonyError("this plan has no weights; pass state_dict= (e.g. model.state_dict())")
            state_dict = graph.state_dict()
        program = plan.program()  # (with its memory promise)
        self.store = HostStore.create(graph, plan.tasks.devices, self.build_optimizer, state_dict,
                                      low_copies=plan.tasks.low_copies,
                                      slots=program.gradient_slots(plan.tasks))
        self.schedule = None if lr_scheduler is None else Schedule.for_graph(graph, self.build_optimizer, lr_scheduler)
        device_type = plan.options.get("device_type", "cpu")
        capacity = plan.worker_capacity()
        self.launcher = Launcher(graph, plan.tasks, program, self.store, self.loss_fn, self.build_optimizer,
                                 device_type=device_type, capacity=capacity, seed=seed, timeout=timeout,
                                 prefetch=prefetch, p2p=p2p, check_memory=check_memory,
                                 clip_grad_norm=self.clip_grad_norm, loss_scale=loss_scale, timing=timing)

    # ------------------------------------------------------------ training
    def step(self, inputs: Any, target: Any) -> float:
        """One minibatch (inputs batch first, a tensor or a tuple; the loss target); returns its
        mean loss."""
        inputs = list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]
        size = int(next(x for x in inputs if isinstance(x, torch.Tensor)).shape[0])
        if size != self.plan.tasks.minibatch:
            raise HarmonyError(f"the plan is for minibatches of {self.plan.tasks.minibatch} samples, got {size}; "
                               "compile a plan for this size")
        if isinstance(target, torch.Tensor) and (target.dim() == 0 or target.shape[0] != size):
            raise HarmonyError(f"the target has {tuple(target.shape)[:1] or 'no'} samples but the inputs have {size}; "
                               "give the target of the same minibatch, batch first")
        batch = Batch(inputs=inputs, target=target, size=size, seed=self.seed)  # the launcher shares it
        result = self.launcher.step(batch, self.schedule.rates() if self.schedule is not None else None)
        self.history.append(result)
        if self.schedule is not None:
            self.schedule.step(result.loss)
        return result.loss

    @property
    def grad_norm(self) -> float | None:
        """The last minibatch's global gradient norm before clipping (what ``clip_grad_norm_``
        returns), in a run that clips; None otherwise."""
        return self.history[-1].grad_norm if self.history else None

    @property
    def lr_scheduler(self) -> Any:
        """The run's learning-rate scheduler (``get_last_lr()`` is the next minibatch's rate), or None."""
        return self.schedule.scheduler if self.schedule is not None else None

    @property
    def iteration(self) -> int:
        return self.launcher.iteration

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights and buffers under the original model's names (copies)."""
        self.launcher.sync()  # state the devices keep across iterations (scheduler/keep.py) first
        return self.store.state_dict(self.plan.graph)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load weights and buffers (all or some, by the original model's names); the optimizer
        state carries on."""
        self.launcher.sync()  # what the devices keep, in the host store before some of it is replaced
        self.store.load_tensors(self.plan.graph, state_dict)
        self.launcher.drop(optimizer=False)

    def save_checkpoint(self, path: str | Path) -> Path:
        """Weights, buffers, optimizer state, the step, the seed and the global random generators'
        states, written atomically and sealed with a checksum (``harmony.checkpoint``): the file
        appears complete or not at all. ``torch.load(path)["model"]`` loads into the original model."""
        self.launcher.sync()
        return checkpoint.write(path, checkpoint.snapshot(self.plan, self.store, self.iteration, self.seed,
                                                          self.schedule, self.launcher.loss_scale))

    def load_checkpoint(self, path: str | Path, restore_rng: bool = True) -> int:
        """Continue from a checkpoint of this model: its weights, optimizer state and step (the
        runtime's dropout masks follow from the seed and the step) and, with ``restore_rng``, the
        global random generators. A file that is damaged or was saved for another model or
        decomposition is refused before anything changes. Returns the step."""
        self.launcher.sync()  # a file refused leaves the store as it was: current
        iteration, self.seed = checkpoint.restore(path, self.plan, self.store, restore_rng, self.schedule,
                                                  self.launcher.loss_scale)
        self.launcher.iteration = iteration
        self.launcher.drop()
        return iteration

    # ------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stop the workers; the host store (``self.store``) then holds the run's final state,
        including what the devices kept."""
        self.launcher.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
