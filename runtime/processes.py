"""How worker processes start: forked where autograd still works in a fork, spawned otherwise, and
spawned without running the user's script again.

**Fork or spawn.** A forked worker inherits the layer code and the user's functions as they are,
and starts in milliseconds; a spawned one imports torch and rebuilds the layer graph from plain
data (a second or two). Forking is only possible while autograd works in the child: the autograd
engine (``torch/csrc/autograd/engine.cpp``) starts one thread per accelerator device at the first
backward pass of a process (``Engine::start_device_threads``, once), and when it does it registers
a ``pthread_atfork`` handler that marks every later fork as bad; a backward in such a child raises
"Unable to handle autograd's threading in combination with fork-based multiprocessing". Whether it
starts any thread depends on every device type the build registered, not on the GPUs visible: a CUDA
build of torch on a machine without a GPU may start several once ``torch.export`` has run (the
decomposer's fallback), while the CPU wheel starts none. A flag that no Python API shows, set by a
backward of the user's, the profiler's or a reference run's. So rather than guess from the build,
``autograd_survives_fork`` asks: it forks a child that runs a one-element backward and reads its
exit code (a few milliseconds), and the answer decides (``start_method``).

**Spawning fast.** Where a fork would break autograd, emulated workers come from a fork server
(``multiprocessing``'s forkserver: a fresh interpreter, started once per process, that has imported
torch and the runtime and never runs a backward pass) and start in milliseconds instead of the
two seconds of importing torch each; CUDA workers are spawned (their CUDA context costs more than
the import). ``harmony/__init__`` imports lazily, so a worker does not load the compiler either.
A worker from the fork server sees the environment the server started with.

**Spawning without the user's script.** ``multiprocessing``'s spawn makes every child import the
parent's ``__main__`` (so that objects pickled by reference to it resolve), which runs a script's
top level again: a script without an ``if __name__ == "__main__":`` guard would compile and train
once more in every worker, and multiprocessing refuses that with its "bootstrapping phase" error.
Harmony's workers need nothing from ``__main__``: the user's functions travel by value
(cloudpickle, ``launcher._by_value``) and the layers as generated source. ``start`` therefore
starts spawned processes with ``sys.modules["__main__"]`` replaced by an empty module for the few
milliseconds of ``Process.start()``, and a script needs no guard.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import types
from collections.abc import Iterable, Iterator
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.multiprocessing as mp

from harmony.errors import HarmonyError

log = logging.getLogger(__name__)

__all__ = ["START_METHOD", "autograd_survives_fork", "context", "start_method", "start"]

START_METHOD = "HARMONY_START_METHOD"
_PROBE_TIMEOUT = 30.0  # seconds for the forked child's backward; it takes milliseconds
_main_swap = threading.Lock()
# torch._dynamo: the first optimizer step imports it (a large part of a worker's start otherwise)
_PRELOAD = ["torch", "torch._dynamo", "harmony.runtime.launcher"]
_fork_broken = False  # once autograd's threads run in this process, every later fork is bad


def _child_backward() -> int:
    """In the forked child: 0 if a backward pass runs."""
    try:
        x = torch.ones(1, requires_grad=True)
        (x * 2).sum().backward()
    except BaseException:  # noqa: BLE001 - any failure means no
        return 1
    return 0


def _wait(pid: int, timeout: float) -> int:
    """The child's exit code; a child still running after ``timeout`` is killed and counts as failed."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -signal.SIGKILL
        time.sleep(0.002)


def autograd_survives_fork() -> bool:
    """Whether a process forked now can run a backward pass (module docs). Asked anew each time
    until the answer is no, which is final for this process."""
    global _fork_broken
    if _fork_broken or not hasattr(os, "fork"):
        return False
    pid = os.fork()
    if pid == 0:
        os._exit(_child_backward())
    ok = _wait(pid, _PROBE_TIMEOUT) == 0
    if not ok:
        _fork_broken = True
        log.info("autograd's device threads run in this process: workers are spawned, not forked")
    return ok


def start_method(device_type: str) -> str:
    """"spawn" for CUDA workers (CUDA cannot be forked); for emulated ones "fork" while a fork can
    run a backward pass, the fork server otherwise (module docs). ``HARMONY_START_METHOD`` asks for
    one (``spawn`` to test the spawned path on any machine); ``fork`` cannot override a broken fork."""
    chosen = os.environ.get(START_METHOD, "")
    if chosen not in ("", "fork", "forkserver", "spawn"):
        raise HarmonyError(f"{START_METHOD}={chosen!r}: choose fork, forkserver or spawn")
    if device_type != "cpu":
        return "spawn"
    if chosen in ("spawn", "forkserver"):
        return chosen
    return "fork" if autograd_survives_fork() else "forkserver"


def context(method: str) -> Any:
    """The ``torch.multiprocessing`` context for ``method``; the fork server preloads torch, what its
    optimizers import and the runtime (the preload applies when the server starts: once per process)."""
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


@contextlib.contextmanager
def _no_main_module() -> Iterator[None]:
    """``__main__`` as an empty module while spawned children are started (module docs)."""
    with _main_swap:
        main = sys.modules.get("__main__")
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield
        finally:
            if main is None:
                del sys.modules["__main__"]
            else:
                sys.modules["__main__"] = main


def start(processes: Iterable[BaseProcess]) -> None:
    """Start ``processes``; spawned ones do not import the user's ``__main__`` (module docs)."""
    for process in processes:
        if process._start_method in ("spawn", "forkserver"):  # noqa: SLF001 - the context that made it
            with _no_main_module():
                process.start()
        else:
            process.start()
