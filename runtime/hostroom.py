"""Room in host memory for what a run keeps in shared memory, checked before it is allocated, and
the allocation itself (``shared_zeros``).

The host store (master weights, optimizer state, gradient slots) and the message slabs
live in POSIX shared memory: ``/dev/shm``, a tmpfs. Writing past a full tmpfs does not raise; the
kernel sends SIGBUS and the process dies with "Bus error" and nothing else (a container's default
``/dev/shm`` is 64 MiB). Host memory the kernel cannot give ends the same way, or in the OOM killer.
So a run asks first: the bytes it is about to map against ``/dev/shm``'s free space and the memory
the kernel says is available, and says which is short, by how much, and what to do.
"""

from __future__ import annotations

import logging
import os

import torch

from harmony.errors import HarmonyError

log = logging.getLogger(__name__)

SHM = "/dev/shm"


def shared_memory_free(path: str = SHM) -> int | None:
    """Bytes free in the shared-memory filesystem (None where there is none to ask: not Linux)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def available_memory() -> int | None:
    """The kernel's estimate of memory available without swapping (``MemAvailable``; None where
    /proc/meminfo does not say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def shared_zeros(n: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """``n`` zeros of ``dtype`` in new shared memory, made there: ``torch.zeros(n).share_memory_()``
    would hold a private copy beside the shared one (a host store twice its size at once)."""
    storage = torch.UntypedStorage._new_shared(n * dtype.itemsize)  # the kernel's pages come zeroed
    return torch.empty(0, dtype=dtype).set_(storage, 0, (n,))


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_room(nbytes: int, what: str, shm: str = SHM, private: int = 0) -> None:
    """Raise a HarmonyError naming ``what`` if ``nbytes`` of shared memory do not fit in ``shm``'s
    free space, or they and ``private`` bytes of the processes' own memory (what a run parks in host
    memory, ``TaskGraph.parked_bytes``) do not fit in the host's available memory."""
    free = shared_memory_free(shm)
    if free is not None and nbytes > free:
        raise HarmonyError(
            f"{what} needs {gib(nbytes)} of shared memory, but {shm} has {gib(free)} free. In a container, "
            f"start it with a larger {shm} (docker run --shm-size={-(-nbytes * 5 // 4 // 2**30)}g); or remove "
            f"what fills {shm} (ls -la {shm}: files named harmony-* are left only by a run that was killed)")
    available = available_memory()
    if available is not None and nbytes + private > available:
        parked = (f" ({gib(nbytes)} of shared memory and {gib(private)} of activations parked between a forward and "
                  "its backward)") if private else ""
        raise HarmonyError(
            f"{what} needs {gib(nbytes + private)} of host memory{parked}, but the kernel reports {gib(available)} "
            "available (MemAvailable); free memory on this host, or train on one with more"
            + ("; or compile with less memory to spare on the host (a plan that recomputes activations parks none)"
               if private else ""))
    log.debug("%s: %d bytes, %s free in %s, %s available", what, nbytes, free, shm, available)
