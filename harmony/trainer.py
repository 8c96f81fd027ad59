"""`harmony.Trainer`: train on a plan as if on one device with unbounded memory (DESIGN.md).

    plan = harmony.compile(model, loss_fn, get_batch, minibatch_size=64, devices=4)
    with harmony.Trainer(plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4)) as trainer:
        for step in range(100):
            loss = trainer.step(*get_batch(64, step))

Each ``step`` is one synchronous SGD iteration over the minibatch: the same losses and weights
as eager training of the model on one process with the plan's microbatches (``runtime/reference``).
The trainer owns the worker processes; ``close()`` (or leaving the ``with`` block) stops them.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable

import torch

from harmony.errors import HarmonyError
from harmony.plan import Plan
from harmony.runtime.executor import Batch
from harmony.runtime.hoststore import HostStore
from harmony.runtime.launcher import Launcher, StepResult

log = logging.getLogger(__name__)

CHECKPOINT_VERSION = 1


def _default_optimizer(params):
    return torch.optim.SGD(params, lr=0.01)


class Trainer:
    """Runs a plan's task graph on its devices, one minibatch per ``step``."""

    def __init__(self, plan: Plan, optimizer: Callable | None = None, loss_fn: Callable | None = None,
                 state_dict: dict[str, torch.Tensor] | None = None, seed: int = 0, timeout: float = 600.0,
                 prefetch: bool = True) -> None:
        self.plan = plan
        self.loss_fn = loss_fn or getattr(plan, "loss_fn", None)
        if self.loss_fn is None:
            raise HarmonyError("the trainer needs the loss function: pass loss_fn=, or compile the plan with harmony.compile")
        self.build_optimizer = optimizer or getattr(plan, "build_optimizer", None) or _default_optimizer
        self.seed = seed
        self.history: list[StepResult] = []
        graph = plan.graph
        if state_dict is None:
            if graph.modules is None:
                raise HarmonyError("this plan has no weights; pass state_dict= (e.g. model.state_dict())")
            state_dict = graph.state_dict()
        self.store = HostStore.create(graph, plan.tasks.devices, self.build_optimizer, state_dict)
        device_type = plan.options.get("device_type", "cpu")
        capacity = plan.options.get("device_memory") or plan.profile.capacity
        self.launcher = Launcher(graph, plan.tasks, self.store, self.loss_fn, self.build_optimizer,
                                 device_type=device_type, capacity=capacity, seed=seed, timeout=timeout,
                                 profile=plan.profile, prefetch=prefetch)

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
        batch = Batch(inputs=[_shared(x) for x in inputs], target=_shared(target), size=size, seed=self.seed)
        result = self.launcher.step(batch)
        self.history.append(result)
        return result.loss

    @property
    def iteration(self) -> int:
        return self.launcher.iteration

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights and buffers under the original model's names (copies)."""
        return self.store.state_dict(self.plan.graph)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.store.load_tensors(self.plan.graph, state_dict)

    def save_checkpoint(self, path: str | Path) -> Path:
        """Weights, buffers, optimizer state and the iteration count, written atomically: the file
        appears complete or not at all."""
        path = Path(path)
        body = {
            "version": CHECKPOINT_VERSION, "graph": self.plan.graph.fingerprint(), "iteration": self.iteration,
            "seed": self.seed, "model": self.state_dict(), "optimizer": self.store.optimizer_state(),
        }
        if not path.parent.is_dir():
            raise HarmonyError(f"cannot save a checkpoint to {path}: the folder {path.parent} does not exist")
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            torch.save(body, tmp)
            os.replace(tmp, path)
        except OSError as exc:
            raise HarmonyError(f"cannot save a checkpoint to {path}: {exc}") from exc
        finally:
            tmp.unlink(missing_ok=True)
        return path

    def load_checkpoint(self, path: str | Path) -> None:
        try:
            body = torch.load(Path(path), weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same answer
            raise HarmonyError(f"{path} is not a readable Harmony checkpoint ({type(exc).__name__}: {exc})") from exc
        if not isinstance(body, dict) or body.get("version") != CHECKPOINT_VERSION:
            raise HarmonyError(f"{path} is not a Harmony checkpoint of version {CHECKPOINT_VERSION}")
        if body.get("graph") != self.plan.graph.fingerprint():
            raise HarmonyError(f"{path} was saved for another model or decomposition; it does not fit this plan")
        self.store.load_tensors(self.plan.graph, body["model"])
        self.store.load_optimizer_state(body["optimizer"])
        self.launcher.iteration = int(body["iteration"])
        self.seed = int(body.get("seed", self.seed))

    # ------------------------------------------------------------ lifetime
    def close(self) -> None:
        self.launcher.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _shared(x: Any) -> Any:
    """A copy of a host tensor in shared memory, so every worker reads the one minibatch."""
    if not isinstance(x, torch.Tensor):
        return x
    out = torch.empty(x.shape, dtype=x.dtype).share_memory_()
    out.copy_(x.detach().cpu())
    return out

