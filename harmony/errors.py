"""The errors Harmony raises for problems a user can fix; each message says the cause and what to do."""


class HarmonyError(Exception):
    """Base class: an error whose message is meant for the user, printed without a traceback by the CLI."""


class ModelFileError(HarmonyError):
    """The model file is missing, fails to import, or lacks a required function."""


class DecomposeError(HarmonyError):
    """The model could not be traced or cut into layers."""


class FormatError(HarmonyError):
    """A Harmony file (graph, profile, plan, checkpoint) is corrupt, truncated or of another version."""


class DeviceOutOfMemoryError(HarmonyError):
    """A device (emulated or CUDA) could not hold an allocation; the profiler catches it to find the
    largest microbatch that fits. The fields travel as ``args`` so the error pickles between workers."""

    def __init__(self, device: str, requested: int | None, current: int, capacity: int | None) -> None:
        super().__init__(device, requested, current, capacity)
        self.device, self.requested, self.current, self.capacity = device, requested, current, capacity

    @staticmethod
    def _fmt(n: int | None) -> str:
        if n is None:
            return "an unknown number of bytes"
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if abs(n) >= size:
                return f"{n / size:.2f} {unit} ({n} bytes)"
        return f"{n} bytes"

    def what(self) -> str:
        """The allocation refused and the device's state, without advice."""
        cap = "unlimited" if self.capacity is None else self._fmt(self.capacity)
        return (f"tried to allocate {self._fmt(self.requested)} with {self._fmt(self.current)} in use of a "
                f"capacity of {cap}")

    def __str__(self) -> str:
        return f"{self.device}: out of memory: {self.what()}; reduce the microbatch size or give the device more memory"
