"""A learning-rate schedule over optimizers that are built afresh for every update.

The runtime never holds one optimizer for the model: each update task builds one over its pack's
parameters (``updates.py``), on a device or on the host. A ``torch.optim.lr_scheduler`` needs one
optimizer whose groups it changes once per minibatch. ``Schedule`` gives it that optimizer: the
user's builder over a stand-in of every trainable parameter (same shape, on the ``meta`` device, so
nothing is allocated), one scheduler over it, stepped once per minibatch after the iteration. Before
each iteration, ``rates()`` reads, for every parameter, the settings a scheduler may change
(``SCHEDULED``) of the group the builder put its stand-in in; an update applies them to the groups
of the optimizer it built (``apply``). The builder sees the same parameter in both places, so the
same group settings: the update runs at the rate eager training with that scheduler would use.

``ReduceLROnPlateau`` is stepped with the minibatch's loss. The scheduler's state travels in
checkpoints (``state_dict``); the stand-ins have no state.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from harmony.errors import HarmonyError

log = logging.getLogger(__name__)

__all__ = ["SCHEDULED", "Rates", "Schedule", "apply"]

SCHEDULED = ("lr", "momentum", "betas")  # group settings torch's schedulers change (cyclic ones: momentum)
Rates = dict[str, dict[str, Any]]  # parameter name -> the scheduled settings of its group


class Schedule:
    """The one optimizer and scheduler a run's learning rate follows; see the module docs."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], build_optimizer: Callable, build_scheduler: Callable) -> None:
        self.names = list(shapes)
        self.stand_ins = [torch.nn.Parameter(torch.empty(shape, device="meta")) for shape in shapes.values()]
        try:
            self.optimizer = build_optimizer(self.stand_ins)
            self.scheduler = build_scheduler(self.optimizer)
        except HarmonyError:
            raise
        except Exception as exc:
            raise HarmonyError(f"building the learning-rate schedule over stand-ins of the parameters failed: "
                               f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(self.scheduler, (torch.optim.lr_scheduler.LRScheduler,
                                           torch.optim.lr_scheduler.ReduceLROnPlateau)):
            raise HarmonyError(f"the learning-rate scheduler builder returned {type(self.scheduler).__name__}, "
                               "not a torch.optim.lr_scheduler scheduler")
        self._group_of = {}
        for index, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                self._group_of[id(p)] = index

    @classmethod
    def for_graph(cls, graph: Any, build_optimizer: Callable, build_scheduler: Callable) -> "Schedule":
        """The schedule over a layer graph's trainable parameters (canonical names, a tied one once)."""
        shapes: dict[str, tuple[int, ...]] = {}
        for name, spec in graph.state.items():
            if spec.kind == "parameter" and spec.requires_grad:
                shapes.setdefault(graph.canonical(name), tuple(spec.shape))
        return cls(shapes, build_optimizer, build_scheduler)

    def rates(self) -> Rates:
        """Per parameter, the settings its group has now (for this minibatch's updates)."""
        out = {}
        for name, p in zip(self.names, self.stand_ins):
            group = self.optimizer.param_groups[self._group_of[id(p)]]
            out[name] = {key: _plain(group[key]) for key in SCHEDULED if key in group}
        return out

    def step(self, loss: float | None) -> None:
        """After a minibatch: the next rate (``ReduceLROnPlateau`` only with a ``loss``). The
        stand-ins have no gradients, so the optimizer's step changes nothing; it is taken because a
        scheduler stepped before any optimizer step warns that the first rate was skipped."""
        self.optimizer.step()
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            if loss is not None:
                self.scheduler.step(loss)
        else:
            self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state and the scheduled settings of the optimizer's groups."""
        groups = [{key: _plain(g[key]) for key in (*SCHEDULED, "initial_lr") if key in g}
                  for g in self.optimizer.param_groups]
        return {"scheduler": self.scheduler.state_dict(), "groups": groups}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["groups"]) != len(self.optimizer.param_groups):
            raise ValueError(f"the saved schedule has {len(state['groups'])} parameter groups, "
                             f"this optimizer {len(self.optimizer.param_groups)}")
        for group, saved in zip(self.optimizer.param_groups, state["groups"]):
            group.update(saved)
        self.scheduler.load_state_dict(state["scheduler"])

    def catch_up(self, steps: int) -> None:
        """Step the schedule ``steps`` times without losses: a run resumed from a checkpoint saved
        without a schedule continues where a scheduled run from the start would be."""
        for _ in range(steps):
            self.step(None)


def apply(optimizer: torch.optim.Optimizer, leaves: dict[str, torch.Tensor], rates: Rates | None) -> None:
    """Give each group of an optimizer built over ``leaves`` (parameter name -> the tensor the
    builder was given) the scheduled settings of its parameters; nothing when there is no schedule."""
    if rates is None:
        return
    names = {id(t): name for name, t in leaves.items()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = names.get(id(p))
            if name in rates:
                group.update(rates[name])
                break


def _plain(value: Any) -> Any:
    """A setting as plain data (a scheduler may keep a tensor rate)."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value
