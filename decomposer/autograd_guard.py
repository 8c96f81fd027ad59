"""What a tracer would lose of a model's autograd behaviour: kept, run eagerly, or refused.

Neither torch.fx nor torch.export sees everything eager autograd does, and what they miss they
drop without an error. Harmony's promise is the gradients eager training gives, so each such
construct is either kept exactly or refused with its name and a remedy:

- **A custom ``torch.autograd.Function``**: under torch.fx its ``apply`` becomes one call in the
  generated layer code, so its own forward and backward run (``traced_apply``); torch.export would
  inline the forward and lose the backward, so there the module calling it is kept whole instead.
  Where that cannot be (torch.fx fails on the model whatever is kept whole: Hugging Face models),
  torch.export inlines it, and the decomposition is accepted only if its gradients equal eager
  autograd's (``gradient_check``): a Function whose backward is its forward's derivative (Bloom's
  GeLU) passes, one whose backward is not (a straight-through estimator) is refused.
- **A tensor hook registered in forward()** (``register_hook``, ``register_post_accumulate_grad_hook``)
  and **``torch.inference_mode`` under torch.export** (which ignores it): the module doing it is
  kept whole (an opaque module, run eagerly, hooks and all). In the model's own forward there is no
  module to keep whole, and the compile is refused.
- **``torch.autograd.grad`` or ``backward()`` inside forward()**: refused. Harmony runs a layer's
  forward without autograd and recomputes it in the backward, so a gradient taken inside the forward
  has no graph to differentiate there.
- **``torch.utils.checkpoint`` with ``use_reentrant=True``**: traced through as the function it
  wraps; Harmony decides itself what to recompute, and the values and gradients are the same.
- **A module backward hook** (``register_full_backward_hook``, its pre-hook): the module is kept
  whole, so that its backward is the module's own and the hook fires (``check_model``); on the
  model itself, refused.
- **Hooks on parameters, uninitialized lazy modules**: refused before tracing (``check_model``):
  the devices work on copies of the parameters.
- **Parameters or buffers created or replaced in forward(), Python attributes a forward changes**
  (a step counter): refused after tracing (``check_unchanged``): the layer code fixes them at
  their traced values.

Grad-mode regions inside forward() (``no_grad``, ``enable_grad``) are kept by ``grad_mode.py``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch.autograd.function import Function
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import CheckpointFunction

from harmony.errors import DecomposeError

# a classmethod in Python on some torch builds, a C classmethod descriptor on others (2.14)
_APPLY = Function.__dict__["apply"]


def original_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``cls.apply`` as torch defines it, whatever is patched in while tracing."""
    return _APPLY.__get__(None, cls)(*args, **kwargs)


@dataclass
class NeedsEager:
    """A construct that only an eagerly run module keeps, and the module whose forward met it
    ("" for the model's own forward)."""

    what: str
    module: str
    function: str = ""  # the custom autograd Function's name, where that is what was met


class NeedsEagerError(RuntimeError):
    """Raised inside a tracer to stop it where a construct needs its module run eagerly."""


class Guard:
    """Watches one trace: the module being run, and the constructs a tracer would lose."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.names = {}
        for name, module in model.named_modules(remove_duplicate=False):
            self.names.setdefault(id(module), name)
        self.stack: list[str] = []
        self.tracer = ""
        self.needs_eager: list[NeedsEager] = []
        self.refused: DecomposeError | None = None
        self.fx_module = ""  # the module torch.fx failed in, before torch.export was tried
        self.fx_failed = False
        self.reasons: dict[str, str] = {}  # why each module was kept whole
        # torch.export may inline custom Functions (no module kept whole lets torch.fx trace the
        # model): their names, for the decomposition's check against eager autograd
        self.inline_functions = False
        self.inlined: list[str] = []

    def where(self) -> str:
        """The innermost module whose forward is running ("" for the root)."""
        return self.stack[-1] if self.stack else ""

    def describe(self) -> str:
        path = self.where()
        return f"module {path!r}" if path else "the model's own forward()"

    def eager(self, what: str, function: str = "") -> NeedsEagerError:
        """Record that ``what`` needs the current module run eagerly; returns the error that stops
        torch.fx (torch.export goes on, inlining it, so that one pass finds every such module)."""
        self.needs_eager.append(NeedsEager(what, self.where(), function))
        return NeedsEagerError(f"{what} in {self.describe()}")

    def refuse(self, what: str, remedy: str) -> DecomposeError:
        """The refusal of ``what`` met in the current module, kept in case the tracer wraps it."""
        self.refused = DecomposeError(f"{self.describe()} {what}. {remedy}")
        return self.refused

    def _push(self, module: torch.nn.Module, *_: Any) -> None:
        self.stack.append(self.names.get(id(module), self.where()))

    def _pop(self, *_: Any) -> None:
        if self.stack:
            self.stack.pop()

    @contextlib.contextmanager
    def watching(self, tracer: str) -> Iterator[None]:
        """Patches in force while ``tracer`` ("fx" or "export") runs the model's forward."""
        self.tracer, self.stack, self.needs_eager, self.refused, self.inlined = tracer, [], [], None, []
        pre = torch.nn.modules.module.register_module_forward_pre_hook(self._push)
        post = torch.nn.modules.module.register_module_forward_hook(self._pop, always_call=True)
        patches = _Patches()
        try:
            patches.set(Function, "apply", classmethod(_traced_apply(self)))
            patches.set(torch.autograd, "grad", _refused_grad(self, "torch.autograd.grad"))
            patches.set(torch.autograd, "backward", _refused_grad(self, "torch.autograd.backward"))
            patches.set(torch.Tensor, "backward", _refused_grad(self, "Tensor.backward"))
            hook = _eager_hook(self)
            for name in ("register_hook", "register_post_accumulate_grad_hook"):
                patches.set(torch.Tensor, name, hook(f"Tensor.{name} (a tensor hook registered in forward())"))
                patches.set(fx.Proxy, name, hook(f"Tensor.{name} (a tensor hook registered in forward())"))
            if tracer == "export":
                patches.set(torch.autograd.grad_mode.inference_mode, "__enter__", _eager_inference(self))
            yield
        finally:
            patches.undo()
            pre.remove()
            post.remove()


class _Patches:
    """Attributes set for the length of a trace, and put back after."""

    def __init__(self) -> None:
        self.saved: list[tuple[Any, str, Any, bool]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        had = name in vars(owner)
        self.saved.append((owner, name, vars(owner).get(name), had))
        setattr(owner, name, value)

    def undo(self) -> None:
        for owner, name, value, had in reversed(self.saved):
            if had:
                setattr(owner, name, value)
            else:
                delattr(owner, name)
        self.saved.clear()


def _traced_apply(guard: Guard):
    """``Function.apply`` while tracing (module docs)."""

    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is CheckpointFunction:  # checkpoint(fn, *args, use_reentrant=True): the function itself
            run_function, _preserve_rng, *inputs = args
            return run_function(*inputs)
        proxy = next((a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, fx.Proxy)), None)
        if proxy is None:
            if guard.tracer == "export" and _has_tensor((args, kwargs)):
                if guard.inline_functions:
                    guard.inlined.append(cls.__qualname__)
                else:
                    guard.eager(f"the custom autograd Function {cls.__qualname__} (torch.export would inline its "
                                "forward and lose its backward)", cls.__qualname__)
            return original_apply(cls, *args, **kwargs)
        if "<locals>" in cls.__qualname__:  # no name to find it by: the module calling it is kept whole
            raise guard.eager(f"the custom autograd Function {cls.__qualname__}, defined in a function, where "
                              "generated layer code cannot find it by name")
        return proxy.tracer.create_proxy("call_function", function_call(cls), args, kwargs)

    return apply


_CALLS: dict[type, Any] = {}


def function_call(cls: type) -> Any:
    """The traced graph's target for ``cls.apply``: a function named for the class, which code
    generation imports as ``cls.apply`` (``codegen._import_line``: torch.fx would name the bound
    method after ``torch.autograd.function``, where ``apply`` is defined)."""
    if cls not in _CALLS:
        def call(*args: Any, **kwargs: Any) -> Any:
            return original_apply(cls, *args, **kwargs)

        call.__name__ = call.__qualname__ = f"{cls.__name__}_apply"
        call.__module__ = "autograd_function"  # fx names the code's global after it (a "__main__" would be mangled)
        call.autograd_function = cls  # type: ignore[attr-defined]
        _CALLS[cls] = call
    return _CALLS[cls]


def _has_tensor(tree: Any) -> bool:
    return any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(tree))


def _refused_grad(guard: Guard, name: str):
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise guard.refuse(
            f"calls {name} inside forward()",
            "Harmony runs a layer's forward without autograd and recomputes it in the backward, so a gradient "
            "taken inside forward() has no graph to differentiate there. Compute it outside the model (in loss_fn "
            "or the training loop), or train this model without Harmony")
    return refused


def _eager_hook(guard: Guard):
    def make(what: str):
        def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
            error = guard.eager(what)
            if isinstance(self, fx.Proxy):
                raise error
            return torch.utils.hooks.RemovableHandle({})  # torch.export: noted, and tracing goes on
        return hook
    return make


def _eager_inference(guard: Guard):
    original = torch.autograd.grad_mode.inference_mode.__enter__

    def enter(self: Any) -> Any:
        if getattr(self, "mode", True):
            guard.eager("torch.inference_mode (which torch.export ignores)")
        return original(self)
    return enter


def check_model(model: torch.nn.Module, opaque: set[str]) -> set[str]:
    """Refuse, before tracing, what no layer code can keep: hooks on parameters, global backward
    hooks, a backward hook on the model itself, lazy modules not yet initialized. Returns the
    modules with backward hooks, to be kept whole (run eagerly, their hooks fire in the backward)."""
    for name, param in model.named_parameters():
        hooks = [kind for kind, attr in (("register_hook", "_backward_hooks"),
                                         ("register_post_accumulate_grad_hook", "_post_accumulate_grad_hooks"))
                 if getattr(param, attr, None)]
        if hooks:
            raise DecomposeError(
                f"parameter {name!r} has a gradient hook ({hooks[0]}). Harmony's devices compute on copies of the "
                "parameters and accumulate gradients there, so the hook would not run. Remove it; clip gradients "
                "with clip_grad_norm=, freeze parameters with requires_grad_(False), or change gradients in the "
                "optimizer")
    module_mod = torch.nn.modules.module
    if getattr(module_mod, "_global_backward_hooks", None) or getattr(module_mod, "_global_backward_pre_hooks", None):
        raise DecomposeError(
            "a global module backward hook is registered (torch.nn.modules.module.register_module_full_backward_hook "
            "or its pre-hook); Harmony's layers run their own backward and would skip it. Remove it before compiling")
    hooked = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
            raise DecomposeError(
                f"module {name!r} ({type(module).__name__}) is a lazy module whose parameters are not created yet; "
                "run the model once on an example batch before compiling, so that its shapes are known")
        if module._backward_hooks or module._backward_pre_hooks:
            if not name:
                raise DecomposeError(
                    f"the model ({type(module).__name__}) has a backward hook on itself (register_full_backward_hook "
                    "or its pre-hook), which no layer can run: the model is cut into layers. Register it on the "
                    "submodule it concerns (that module is then kept whole and its hook runs), or remove it")
            if not _inside(name, opaque | hooked):
                hooked.add(name)
    return hooked


def _inside(name: str, opaque: set[str]) -> bool:
    return any(name == path or name.startswith(path + ".") for path in opaque)


@dataclass
class Snapshot:
    """The model's tensors and plain Python attributes, to see what a forward changed."""

    tensors: dict[str, int]
    attrs: dict[tuple[str, str], Any]


_PLAIN = (int, float, bool, str, type(None))


def snapshot(model: torch.nn.Module) -> Snapshot:
    tensors = {name: id(t) for name, t in list(model.named_parameters(remove_duplicate=False))
               + list(model.named_buffers(remove_duplicate=False))}
    attrs = {(name, key): value for name, module in model.named_modules()
             for key, value in vars(module).items() if not key.startswith("_") and isinstance(value, _PLAIN)}
    return Snapshot(tensors, attrs)


def check_unchanged(model: torch.nn.Module, before: Snapshot) -> None:
    """Refuse a model whose forward, while traced, created or replaced a parameter or buffer, or
    changed a plain Python attribute: the generated layers hold the state and the values they saw."""
    after = snapshot(model)
    changed = sorted(name for name in set(before.tensors) | set(after.tensors)
                     if before.tensors.get(name) != after.tensors.get(name))
    if changed:
        raise DecomposeError(
            f"forward() creates or replaces the model's parameters or buffers ({', '.join(changed[:3])}); Harmony "
            "places and trains the state the model has when it is compiled. Create them in __init__ (for a lazy "
            "module: run the model once before compiling), and update buffers in place (buf.copy_(...))")
    moved = [(path, key, before.attrs[(path, key)], after.attrs.get((path, key)))
             for path, key in before.attrs if after.attrs.get((path, key)) != before.attrs[(path, key)]]
    if moved:
        path, key, old, new = moved[0]
        owner = f"{path}.{key}" if path else key
        raise DecomposeError(
            f"forward() changes the Python attribute {owner!r} ({old!r} -> {new!r}); the traced layer code keeps "
            "the value it saw, so every later step would run with it. Keep such state in a buffer "
            "(self.register_buffer) updated in place, or pass it as an input")
