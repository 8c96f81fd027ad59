"""The host's Adam and AdamW: one pass per tensor, in a kernel compiled for the host's CPU.

On the CPU, Adam is bound by its arithmetic as much as by memory: a square root and two divisions
per element. Torch's fused kernel (``fused=True``) vectorizes them at the width torch was built
for, one vector at a time; DeepSpeed's CPUAdam, the step offloading users compare with, unrolls
wider vectors and reorders the arithmetic (one division, and results that differ from torch's).
:class:`HostAdam` steps torch's own ``Adam`` and ``AdamW`` with ``host_adam.c``: the loop's order
of operations (so its results stay within rounding of the optimizer as built), compiled for the
CPU it runs on (``-march=native``, 512-bit vectors where the CPU has them, unrolled), and spread
over the calling thread's torch thread count (ctypes lets go of the GIL during the call).
``python -m bench.host_step`` compares the three.

The kernel is built on first use by the system's C compiler into Harmony's kernel cache
(``~/.cache/harmony/kernels``, or ``$HARMONY_KERNEL_CACHE``), named by a hash of the source, the
flags and the CPU, written to a temporary name and renamed, so that processes building at once
never load half a library. Where there is no compiler or the build fails, ``kernel()`` is None
(logged once) and the host steps with torch's fused kernel instead (``host_step.py``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

__all__ = ["HostAdam", "kernel", "unsupported"]

SOURCE = Path(__file__).with_name("host_adam.c")
CLASSES = (torch.optim.Adam, torch.optim.AdamW)
DTYPES = {torch.float32: "harmony_adam_f32", torch.float64: "harmony_adam_f64"}
# from the most to the least specific: a compiler or CPU without an option falls back to the next
_FLAG_SETS = (
    ["-O3", "-march=native", "-mprefer-vector-width=512"],
    ["-O3", "-march=native"],
    ["-O3"],
)
_COMMON_FLAGS = ["-shared", "-fPIC", "-fno-math-errno", "-ffp-contract=off", "-std=c99"]
_PER_THREAD = 1 << 16  # elements below which a tensor is not worth splitting over threads
_LINE = 16  # elements of the widest type in a 128-byte span: whole cache lines


def cache_root() -> Path:
    return Path(os.environ.get("HARMONY_KERNEL_CACHE") or Path.home() / ".cache" / "harmony" / "kernels")


def _cpu_identity() -> str:
    """What ``-march=native`` compiles for: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [line for line in text.splitlines() if line.startswith(("model name", "flags", "Features"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _build(compiler: str, flags: list[str], target: Path) -> bool:
    """Compile the source into ``target`` with ``flags``; whether it built."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=target.stem, suffix=".part")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, *_COMMON_FLAGS, str(SOURCE), "-o", partial, "-lm"],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            log.debug("building the host's Adam kernel with %s failed: %s", " ".join(flags), done.stderr.strip())
            return False
        os.replace(partial, target)
        return True
    except (OSError, subprocess.SubprocessError) as exc:
        log.debug("building the host's Adam kernel failed: %s", exc)
        return False
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


@functools.cache
def kernel() -> ctypes.CDLL | None:
    """The compiled kernel (built on first use, see the module docs), or None where it cannot be built."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler: the host steps Adam with torch's fused kernel")
        return None
    source = SOURCE.read_bytes()
    for flags in _FLAG_SETS:
        key = hashlib.sha256(b"\0".join([source, compiler.encode(), " ".join(flags + _COMMON_FLAGS).encode(),
                                         _cpu_identity().encode()])).hexdigest()[:16]
        target = cache_root() / f"host_adam-{key}.so"
        if target.exists() or _build(compiler, flags, target):
            try:
                return _declare(ctypes.CDLL(str(target)))
            except OSError as exc:
                log.debug("loading %s failed: %s", target, exc)
    log.info("the host's Adam kernel did not build (%s): the host steps Adam with torch's fused kernel", compiler)
    return None


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    for dtype, name in DTYPES.items():
        scalar = ctypes.c_float if dtype == torch.float32 else ctypes.c_double
        fn = getattr(lib, name)
        fn.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [scalar] * 4 + [ctypes.c_int]
                       + [scalar] * 5)
        fn.restype = None
    return lib


def unsupported(optimizer: torch.optim.Optimizer) -> str | None:
    """Why :class:`HostAdam` cannot step ``optimizer``'s algorithm, or None. ``host_step`` has
    checked the rest (torch's own classes, CPU weights of a fused dtype, dense gradients, no
    capturable or differentiable group, no hooks)."""
    if type(optimizer) not in CLASSES:
        return f"{type(optimizer).__qualname__} is not Adam"
    for group in optimizer.param_groups:
        if group.get("amsgrad"):
            return "a group keeps amsgrad's maximum"
        if any(isinstance(x, torch.Tensor) for x in (group["lr"], *group["betas"])):
            return "a group's rate or betas are tensors"
    if kernel() is None:
        return "the kernel did not build"
    return None


def _scalar_dtype() -> torch.dtype:
    """The dtype torch's Adam keeps its step count in."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


@functools.cache
def _pool(threads: int, pid: int) -> ThreadPoolExecutor:
    """Threads to split a tensor over; per process, since a forked child inherits none of its
    parent's threads."""
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="harmony-adam")


class HostAdam(torch.optim.Optimizer):
    """``Adam`` or ``AdamW`` (as ``twin_of`` finds it) stepped by the compiled kernel; its state is
    torch's (``step``, ``exp_avg``, ``exp_avg_sq``), so the two take over from each other."""

    def __init__(self, param_groups: list[dict[str, Any]], defaults: dict[str, Any], decoupled: bool) -> None:
        super().__init__(param_groups, defaults)
        self.decoupled = decoupled

    @classmethod
    def twin_of(cls, optimizer: torch.optim.Optimizer) -> "HostAdam":
        """A HostAdam over ``optimizer``'s groups and settings (``unsupported`` must be None)."""
        groups = [{**group, "params": list(group["params"])} for group in optimizer.param_groups]
        return cls(groups, dict(optimizer.defaults), isinstance(optimizer, torch.optim.AdamW))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch.optim.Optimizer.step
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_one(p, group)
        return loss

    def _step_one(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        step = float(state["step"])
        lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
        decoupled = self.decoupled or group.get("decoupled_weight_decay", False)
        lerp = 1 - beta1
        scalars = (-1.0 if group["maximize"] else 1.0, 0.0 if decoupled else wd,
                   1 - lr * wd if decoupled else 1.0, lerp, int(abs(lerp) >= 0.5), beta2, 1 - beta2,
                   math.sqrt(1 - beta2 ** step), group["eps"], -(lr / (1 - beta1 ** step)))
        tensors = (p, p.grad, state["exp_avg"], state["exp_avg_sq"])
        whole = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        _run(getattr(kernel(), DTYPES[p.dtype]), whole, scalars)
        for t, w in zip(tensors, whole):
            if w is not t and t is not p.grad:
                t.copy_(w)


def _run(fn, tensors: list[torch.Tensor], scalars: tuple) -> None:
    """``fn`` over the tensors' elements, split over the calling thread's torch threads."""
    n = tensors[0].numel()
    pointers = [t.data_ptr() for t in tensors]
    threads = min(torch.get_num_threads(), max(1, n // _PER_THREAD))
    if threads == 1:
        fn(*pointers, 0, n, *scalars)
        return
    # cut at cache lines' multiples, so that no two threads write one line
    bounds = [n * i // threads // _LINE * _LINE for i in range(threads)] + [n]
    futures = [_pool(threads, os.getpid()).submit(fn, *pointers, a, b, *scalars) for a, b in zip(bounds, bounds[1:])]
    for future in futures:
        future.result()
