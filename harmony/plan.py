"""The plan directory: everything `harmony compile` decided, in files a person and a worker can read.

    manifest.json    versions, the model file's path and SHA-256, the options
    graph.msgpack    the layer graph          layers/  one generated module per layer
    profile.msgpack  the layer profiles and the machine description
    plan.msgpack     the configuration, the task graph, the estimate, the mode comparison
    program.msgpack  the task graph lowered: per device and stream, the ordered actions
    trace.json       the simulated timeline (Chrome trace format; open in Perfetto)
    summary.md       the same for people

A plan is refused when its files disagree with each other (a graph, profile and task graph made
at different times) or with the model file it was compiled from, with a message saying what
changed and to compile again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from harmony import __version__, serialization
from harmony.decomposer.layer_graph import LayerGraph
from harmony.errors import FormatError, HarmonyError
from harmony.modelfile import source_hash
from harmony.profiling.profiles import PROFILE_FILE, Profile
from harmony.runtime.hostroom import gib
from harmony.runtime.hoststore import describe_kinds
from harmony.scheduler.memory import kept_bytes, kept_on
from harmony.scheduler.estimator import promise
from harmony.scheduler.lower import Program, lower
from harmony.scheduler.machine import nominal_machine
from harmony.scheduler.tasks import HOST, TaskGraph

log = logging.getLogger(__name__)


SCHEMA_VERSION = 1
KIND = "plan"
PLAN_FILE = "plan.msgpack"
MANIFEST = "manifest.json"


class StalePlanError(HarmonyError):
    """The plan no longer matches its model file or its own parts."""


HARMONY_MODES = ("pp", "dp")  # Harmony's own modes; the comparison's others are the paper's baselines
FASTER_BY = 1.05  # how much faster another mode must be estimated before the comparison says so


@dataclass
class Plan:
    graph: LayerGraph
    profile: Profile
    tasks: TaskGraph
    estimate: dict[str, Any]  # iteration_time, fits, peak_memory, bytes_by_channel, busy
    options: dict[str, Any] = field(default_factory=dict)
    comparison: list[dict[str, Any]] = field(default_factory=list)  # one row per mode considered
    model_file: str = ""
    model_sha256: str = ""
    search: dict[str, Any] = field(default_factory=dict)  # explored configurations, seconds
    # kept by a plan compiled in this process, never saved: the user's functions for the trainer
    # that runs it, the estimate's Chrome trace and timeline (a loaded plan has none)
    loss_fn: Callable | None = field(default=None, repr=False, compare=False)
    get_batch: Callable | None = field(default=None, repr=False, compare=False)
    build_optimizer: Callable | None = field(default=None, repr=False, compare=False)
    trace: dict | None = field(default=None, repr=False, compare=False)
    events: list | None = field(default=None, repr=False, compare=False)
    # the tasks lowered (``program()``): read from the plan directory, or lowered once here
    lowered: Program | None = field(default=None, repr=False, compare=False)

    # ------------------------------------------------------------ files
    def worker_capacity(self) -> int:
        """Bytes each worker's device gives the plan's tensors. A profile measured on a GPU holds
        what the user gave less the workspaces the BLAS libraries keep (``CudaDevice.warm_up``),
        which a worker then allows on top; elsewhere it is the given device memory, or the
        profile's (an analytic device's) where none was given."""
        if self.options.get("device_type") == "cuda" and self.profile.source == "measured":
            return self.profile.capacity
        return self.options.get("device_memory") or self.profile.capacity

    def save(self, directory: str | Path, trace: dict | None = None) -> Path:
        """Write the plan directory (``trace``: a Chrome trace of the estimate, see
        ``estimator.chrome_trace``); the manifest goes last, so a half-written plan has none."""
        trace = trace if trace is not None else self.trace
        self.promise_memory()  # a saved plan is runnable: it carries its memory promise

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / MANIFEST).unlink(missing_ok=True)
        self.graph.save(directory)
        self.profile.save(directory / PROFILE_FILE)
        body = {
            "graph_fingerprint": self.graph.fingerprint(),
            "tasks": self.tasks.to_dict(),
            "estimate": self.estimate,
            "options": self.options,
            "comparison": self.comparison,
            "search": self.search,
        }
        serialization.save(directory / PLAN_FILE, KIND, SCHEMA_VERSION, body)
        self.program().save(directory)
        if trace is not None:
            serialization.atomic_write_bytes(directory / "trace.json", json.dumps(trace).encode())
        serialization.atomic_write_bytes(directory / "summary.md", self.summary().encode())
        manifest = {
            "harmony": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "schema": {"plan": SCHEMA_VERSION}, "model_file": self.model_file, "model_sha256": self.model_sha256,
            "options": self.options,
        }
        serialization.atomic_write_bytes(directory / MANIFEST, serialization.json_seal(manifest))
        return directory

    def promise_memory(self) -> None:
        """Attach the memory promise to a plan whose task graph was searched outside ``compile`` (a
        script or test that calls ``search`` itself): the runtime admits every copy made ahead of
        need against it, so no plan runs without one. The estimate is the one the search made: the
        profile's machine (nominal copy speeds where it has none) at the plan's device count and
        planned memory."""
        if self.tasks.memory is not None:
            return
        capacity = self.profile.capacity
        devices = self.tasks.devices
        machine = self.profile.machine or nominal_machine(self.options.get("device_type", "cpu"), devices, capacity)
        if machine.devices != devices:
            machine = dataclasses.replace(machine, devices=devices)
        self.tasks.memory = promise(self.tasks, self.profile, machine, self.options.get("planned_memory", capacity))
        log.info("the plan had no memory promise (searched outside compile); estimated one: peaks %s",
                 self.tasks.memory.devices)

    def program(self) -> Program:
        """The plan's tasks as one action program per device (``scheduler/lower.py``), what its
        workers run: a loaded plan's is the one saved beside its tasks; a plan compiled or put
        together in this process is lowered once, with its memory promise."""
        if self.lowered is None or self.lowered.tasks != self.tasks.fingerprint():
            self.promise_memory()
            self.lowered = lower(self.tasks, self.profile, params=self.graph.parameter_layers())
        return self.lowered

    @classmethod
    def load(cls, directory: str | Path, model_file: str | Path | None = None, device: str = "cpu") -> "Plan":
        """Read a plan directory, checking that its parts belong together and, given the model
        file, that the model has not changed since the plan was compiled."""
        directory = Path(directory)
        manifest = read_manifest(directory)
        if model_file is not None:
            now = source_hash(Path(model_file))
            if manifest.get("model_sha256") != now:
                raise StalePlanError(
                    f"{model_file} changed since the plan in {directory} was compiled "
                    f"(SHA-256 {str(manifest.get('model_sha256'))[:12]}… then, {now[:12]}… now); run harmony compile again"
                )
        source = str(directory / PLAN_FILE)
        body = serialization.load(directory / PLAN_FILE, KIND, SCHEMA_VERSION)
        with serialization.decoding(source, "plan"):
            _check_body(body)
            tasks = TaskGraph.from_dict(body["tasks"])
            _check_tasks(tasks)
        graph = LayerGraph.load(directory, device=device)
        if body["graph_fingerprint"] != graph.fingerprint():
            raise StalePlanError(
                f"{source} and {directory / 'graph.msgpack'} do not belong together (the plan was made for layer graph "
                f"{body['graph_fingerprint'][:12]}…, the graph is {graph.fingerprint()[:12]}…); compile again")
        profile = Profile.load(directory / PROFILE_FILE)
        if profile.graph_hash and profile.graph_hash != graph.fingerprint():
            raise StalePlanError(f"{directory}/{PROFILE_FILE} was made for another layer graph; compile again")
        if json.loads(json.dumps(body.get("options", {}), default=str)) != manifest.get("options", {}):
            raise StalePlanError(f"{source} was compiled with other options than {directory / MANIFEST} names; "
                                 "compile again")
        if len(profile.layers) != len(graph.layers) or any(t.last >= len(graph.layers) for t in tasks.tasks):
            raise StalePlanError(f"{source} does not fit its graph and profile ({len(graph.layers)} layers, "
                                 f"{len(profile.layers)} profiled); compile again")
        return cls(
            graph=graph, profile=profile, tasks=tasks, estimate=body["estimate"],
            options=body.get("options", {}), comparison=body.get("comparison", []),
            model_file=manifest.get("model_file", ""), model_sha256=manifest.get("model_sha256", ""),
            search=body.get("search", {}), lowered=Program.load(directory, tasks),
        )

    # ------------------------------------------------------------ people
    def coarsely_compared(self) -> list[str]:
        """The comparison's modes searched over fewer pack counts than a compile of that mode tries
        (``search.pack_doublings``): their rows may be a little slow."""
        return [row["mode"] for row in self.comparison if row.get("coarse") and row.get("iteration_time") is not None]

    def faster_mode(self) -> tuple[str, float] | None:
        """Harmony's other mode (pp or dp) and how many times faster the comparison estimates it than
        this plan's, where it is at least ``FASTER_BY`` faster: a model that fits each device with
        room to spare trains faster data parallel, without pp's recompute (``bench.peers``: dp at 0.89
        of two cores' eager rate, pp at 0.68), and a user who did not ask for the comparison's
        table should not have to read it to learn that. None where the plan's mode is the fastest."""
        own = next((row.get("iteration_time") for row in self.comparison if row["mode"] == self.tasks.mode), None)
        if not own:
            return None
        others = [(row["iteration_time"], row["mode"]) for row in self.comparison
                  if row["mode"] in HARMONY_MODES and row["mode"] != self.tasks.mode and row.get("iteration_time")]
        if not others:
            return None
        best, mode = min(others)
        return (mode, own / best) if own / best >= FASTER_BY else None

    def comparison_note(self) -> str:
        """The lines under the comparison table: Harmony's other mode where it is estimated faster
        (``faster_mode``), and the coarsely searched rows ("" if neither)."""
        notes = []
        if faster := self.faster_mode():
            mode, times = faster
            notes.append(f"{mode} is estimated {times:.2f}x faster than {self.tasks.mode} here: "
                         f"compile with `--mode {mode}` to train with it.")
        if coarse := self.coarsely_compared():
            notes.append(f"{', '.join(coarse)}: searched over fewer pack counts than a compile of that mode does "
                         "(`harmony compile --mode MODE` searches it fully).")
        return " ".join(notes)

    def host_memory_text(self) -> str:
        """What the run keeps in host shared memory (``/dev/shm``): the host store, by kind."""
        parts = describe_kinds(self.estimate.get("host_store", {}))
        text = f"{gib(self.estimate['host_store_bytes'])} of shared memory for the host store ({parts})"
        if parked := self.tasks.parked_bytes():
            text += (f", and up to {gib(parked)} of the workers' own for activations parked between a forward "
                     "and its backward (stashed inputs, swapped activations)")
        return text

    def kept_text(self) -> str | None:
        """What the devices keep across iterations (``scheduler/keep.py``), or None."""
        on = kept_on(self.tasks)
        if not on:
            return None
        held = kept_bytes(self.tasks, self.profile.for_graph(self.tasks))
        parts = [f"dev{device} {len(on[device])} of {len(self.graph.layers)} layers ({gib(held[device])})"
                 for device in sorted(on)]
        return ("; ".join(parts) + ": their weights, buffers and optimizer state stay on the device and are "
                "stepped there, written back to host memory when it is read (a checkpoint, the end of the run)")

    def activations_text(self) -> str:
        """What each backward pack does for the activations it needs: kept on the device since its
        forward (with the bytes a microbatch keeps), swapped to host memory and back (with the bytes
        a microbatch moves each way), recomputed from its stashed input, or, for the last pack,
        computed in the loss task with its forward."""
        config = self.tasks.config
        words = {"keep": "kept from the forward", "swap": "swapped to host memory and back", "recompute": "recomputed",
                 "loss": "forward, loss and backward in one task"}
        parts = []
        for (first, last), choice in config.choices():
            name = f"L{first}" if first == last else f"L{first}-{last}"
            text = f"{name} {words[choice]}"
            if choice == "keep":
                text += f" ({self.profile.pack_kept_bytes(first, last, config.u_b):,} bytes a microbatch)"
            elif choice == "swap":
                text += f" ({self.profile.pack_swapped_bytes(first, last, config.u_b):,} bytes a microbatch)"
            parts.append(text)
        return "; ".join(parts)

    def summary(self) -> str:
        est = self.estimate
        lines = [
            f"# Harmony plan: {self.tasks.mode} on {self.tasks.devices} device(s), minibatch {self.tasks.minibatch}",
            "",
            f"- model: `{self.model_file or self.graph.model_class}` ({len(self.graph.layers)} layers)",
            f"- profile: {self.profile.source} on {self.profile.device}, capacity {self.profile.capacity:,} bytes per device",
            f"- configuration: {self.tasks.config}",
            f"- activations: {self.activations_text()}",
            f"- estimated iteration time: {est.get('iteration_time', float('nan')):.6f} s"
            + (" ({:.6f}-{:.6f} s at the 10th and 90th percentiles of the calibration's task readings)"
               .format(*est["iteration_time_range"]) if est.get("iteration_time_range") else ""),
            f"- search: {self.search.get('explored', '?')} configurations in {self.search.get('seconds', float('nan')):.2f} s",
        ]
        if self.tasks.precision != "fp32":
            lines.append(f"- precision: {self.tasks.precision} under torch.autocast (weights, gradients and optimizer "
                         "state float32)")
        if self.tasks.low_copies:
            copies = self.profile.for_graph(self.tasks).low_copies
            trainable = sum(c.trainable for c in copies)
            lines.append(f"- {len(copies)} weights ({len(copies) - trainable} frozen, {trainable} trainable and stepped "
                         f"on the host) move as {self.tasks.precision} copies cast on the host "
                         f"({sum(c.saved for c in copies):,} bytes less per copy of the model)")
        if "host_store_bytes" in est:
            lines.append(f"- host memory: {self.host_memory_text()}")
        if kept := self.kept_text():
            lines.append(f"- kept on the devices across iterations: {kept}")
        if self.options.get("clip_grad_norm") is not None:
            lines.append(f"- gradient clipping: global 2-norm {self.options['clip_grad_norm']:g}; every update waits "
                         "for the host's NORM task")
        lines += [
            "",
            "## Bytes per iteration",
            "",
            "| channel | bytes |",
            "|---|---:|",
        ]
        lines += [f"| {k} | {v:,} |" for k, v in sorted(est.get("bytes_by_channel", {}).items())]
        lines += ["", "## Peak memory per device", "", "| device | peak bytes |", "|---|---:|"]
        lines += [f"| {k} | {v:,} |" for k, v in sorted(est.get("peak_memory", {}).items(), key=lambda kv: int(kv[0]))]
        if self.comparison:
            lines += ["", "## Modes compared", "", "| mode | iteration s | swap bytes | peak bytes | configuration |", "|---|---:|---:|---:|---|"]
            for row in self.comparison:
                if row.get("iteration_time") is None:
                    lines.append(f"| {row['mode']} | - | - | - | {row.get('config', '')} |")
                    continue
                lines.append(
                    f"| {row['mode']} | {row.get('iteration_time', float('nan')):.6f} | {row.get('swap_bytes', 0):,} | "
                    f"{row.get('peak_memory', 0):,} | {row.get('config', '')} |"
                )
            if note := self.comparison_note():
                lines += ["", note]
        lines += ["", "## Tasks", "", "```", self.tasks.to_text().rstrip(), "```", ""]
        return "\n".join(lines)


# the plan body's fields and their types; anything else is a file this version cannot read
_BODY_TYPES = {"graph_fingerprint": str, "tasks": dict, "estimate": dict, "options": dict, "comparison": list,
               "search": dict}


def _check_body(body: Any) -> None:
    if not isinstance(body, dict):
        raise FormatError(f"the body is a {type(body).__name__}, not a mapping")
    for key, kind in _BODY_TYPES.items():
        if key in ("options", "comparison", "search") and key not in body:
            continue
        if not isinstance(body.get(key), kind):
            raise FormatError(f"field {key!r} is missing or not a {kind.__name__}")


def _check_tasks(tasks: TaskGraph) -> None:
    """The numbers the runtime indexes with are integers in range (the task graph's own reader
    checks the structure, not the values)."""
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (tasks.devices, tasks.minibatch)):
        raise FormatError(f"the device count {tasks.devices!r} and minibatch {tasks.minibatch!r} must be positive integers")
    for t in tasks.tasks:
        numbers = (t.id, t.device, t.first, t.last, t.offset, *t.microbatches)
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers) \
                or not HOST <= t.device < tasks.devices or not 0 <= t.first <= t.last:
            raise FormatError(f"task {t.id!r} has an out-of-range or non-integer device, layer or microbatch")


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The plan directory's manifest, refused by name when missing, damaged, edited or of another
    schema version; the other files are only read once it is good."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FormatError(f"{directory} is not a complete plan (no {MANIFEST}); compile it again")
    manifest = serialization.json_open(path.read_bytes(), str(path))
    schema = manifest.get("schema")
    version = schema.get("plan") if isinstance(schema, dict) else None
    if version != SCHEMA_VERSION:
        raise FormatError(f"{path} is of plan schema version {version}, this Harmony reads version {SCHEMA_VERSION}; "
                          "compile the plan again")
    for key in ("model_file", "model_sha256"):
        if not isinstance(manifest.get(key, ""), str):
            raise FormatError(f"{path} is corrupt: {key!r} is not a string; compile the plan again")
    if not isinstance(manifest.get("options", {}), dict):
        raise FormatError(f"{path} is corrupt: 'options' is not a mapping; compile the plan again")
    return manifest
