"""Parameters per second of an offloaded update's optimizer step on the host, beside torch's CPU
optimizers and DeepSpeed's CPUAdam, on the same parameters and the same thread count.

Harmony's row is what a host update runs (``runtime/updates.step_on_host``): the master weights,
gradient slot and AdamW state of a pack in a host store in shared memory, the user's optimizer
built over them each step, the learning-rate schedule's settings applied, the step (torch's fused
kernel, ``runtime/host_step.py``) and the state written back. The others are the optimizer a
training loop keeps from one step to the next: torch's AdamW as built (its single-tensor loop on
the CPU), with ``foreach=True``, with ``fused=True`` (the kernel Harmony's step runs), and
DeepSpeed's ``DeepSpeedCPUAdam`` (AVX, compiled on first use; a row says why where it is not
installed or does not build). Every row steps the same number of times from the same weights with
the same gradients; the last column is each one's largest difference from torch's default after
those steps, relative to the tensor's scale.

The pack is transformer blocks' weights (GPT-2 small's by default: 7.1 M parameters in 12 tensors a
block), float32. Rounds interleave the rows; a row's figure is its median step.

    python -m bench.host_step [--blocks 1] [--width 768] [--threads 1] [--rounds 7] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from rich.console import Console
from rich.table import Table

from harmony.runtime.hostroom import shared_zeros
from harmony.runtime.hoststore import ALIGN, HostStore, Layout, state_layout
from harmony.runtime.updates import step_on_host

log = logging.getLogger(__name__)

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
STEPS_PER_ROUND = 3


def adamw(params: list[torch.Tensor], **flags) -> torch.optim.Optimizer:
    """The user's optimizer of every row."""
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, **flags)


def block_shapes(width: int, blocks: int) -> dict[str, tuple[int, ...]]:
    """The weights of ``blocks`` GPT-2 blocks of ``width``: attention, projection, MLP, two norms."""
    shapes: dict[str, tuple[int, ...]] = {}
    for b in range(blocks):
        for name, shape in (("ln1.weight", (width,)), ("ln1.bias", (width,)),
                            ("attn.qkv.weight", (3 * width, width)), ("attn.qkv.bias", (3 * width,)),
                            ("attn.proj.weight", (width, width)), ("attn.proj.bias", (width,)),
                            ("ln2.weight", (width,)), ("ln2.bias", (width,)),
                            ("mlp.fc.weight", (4 * width, width)), ("mlp.fc.bias", (4 * width,)),
                            ("mlp.proj.weight", (width, 4 * width)), ("mlp.proj.bias", (width,))):
            shapes[f"h{b}.{name}"] = shape
    return shapes


@dataclass
class Row:
    """One implementation: how to step it, and its measured steps."""

    name: str
    step: Callable[[], None] | None
    weights: list[torch.Tensor]
    note: str = ""
    seconds: list[float] = field(default_factory=list)


def harmony_row(shapes: dict[str, tuple[int, ...]], weights: list[torch.Tensor],
                grads: list[torch.Tensor]) -> Row:
    """The host store of one device's gradient slots and the pack's AdamW state, stepped as an
    offloaded update steps it."""
    layout = Layout(devices=1)
    for name, shape in shapes.items():
        layout.params.append(name)
        layout.add(f"W/{name}", shape, torch.float32)
        keys = state_layout(torch.empty(shape, device="meta"), adamw)
        layout.state_keys[name] = list(keys)
        for key, (state_shape, dtype) in keys.items():
            layout.add(f"K/{name}/{key}", state_shape, dtype)
        layout.add(f"G/0/{name}", shape, torch.float32)
    store = HostStore(layout, shared_zeros(max(layout.size, ALIGN), torch.uint8),
                      shared_zeros(len(layout.params) * 2, torch.int64))
    for name, w, g in zip(shapes, weights, grads):
        store.weight(name).copy_(w)
        store.grad_slot(0, name).copy_(g)
    names = list(shapes)
    iteration = [0]

    def step() -> None:
        for name in names:  # the device's deposit of this iteration's gradient (written once above)
            store.stamp_slot(0, name, iteration[0])
        step_on_host(store, names, adamw, iteration[0])
        iteration[0] += 1

    return Row("harmony host step", step, [store.weight(name) for name in names],
               "runtime.updates.step_on_host over a host store")


def torch_row(name: str, weights: list[torch.Tensor], grads: list[torch.Tensor], note: str, **flags) -> Row:
    params = _params(weights, grads)
    return Row(name, adamw(params, **flags).step, params, note)


def deepspeed_row(weights: list[torch.Tensor], grads: list[torch.Tensor]) -> Row:
    """DeepSpeed's CPUAdam in AdamW mode, or a row without a step saying why there is none."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as exc:  # not installed, or its import fails on this machine
        return Row("deepspeed CPUAdam", None, [], f"not available: {type(exc).__name__}: {_first_line(exc)}")
    params = _params(weights, grads)
    try:
        opt = DeepSpeedCPUAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, adamw_mode=True)
    except Exception as exc:  # its op did not build (no compiler, no ninja, an unsupported CPU)
        return Row("deepspeed CPUAdam", None, [], f"did not build: {type(exc).__name__}: {_first_line(exc)}")
    import deepspeed

    return Row("deepspeed CPUAdam", opt.step, params, f"deepspeed {deepspeed.__version__}, adamw_mode")


def _params(weights: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return params


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:160]


def measure(rows: list[Row], rounds: int) -> None:
    """A first step each (it creates the state), then ``rounds`` rounds of ``STEPS_PER_ROUND``
    timed steps of every row in turn."""
    live = [row for row in rows if row.step is not None]
    with torch.no_grad():
        for row in live:
            row.step()
        for _ in range(rounds):
            for row in live:
                for _ in range(STEPS_PER_ROUND):
                    start = time.perf_counter()
                    row.step()
                    row.seconds.append(time.perf_counter() - start)


def difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest difference of ``a`` from ``b``, relative to each tensor's largest value."""
    return max(float((x.detach() - y.detach()).abs().max() / y.detach().abs().max()) for x, y in zip(a, b))


def table(rows: list[Row], numel: int) -> tuple[Table, list[list[str]], list[str]]:
    """The rich table, its rows as text, and lines of Harmony's rate over torch default's and over
    DeepSpeed's (where it ran)."""
    reference = next(row for row in rows if row.name == "torch default")
    rates = {row.name: numel / statistics.median(row.seconds) for row in rows if row.seconds}
    out = Table(title=f"AdamW step over {numel / 1e6:.2f} M float32 parameters")
    for column in ("implementation", "M params/s", "ms / step", "vs torch default", "difference from torch default",
                   "notes"):
        out.add_column(column, justify="left" if column in ("implementation", "notes") else "right")
    text = []
    for row in rows:
        if row.name in rates:
            cells = [row.name, f"{rates[row.name] / 1e6:.0f}", f"{statistics.median(row.seconds) * 1e3:.2f}",
                     f"{rates[row.name] / rates[reference.name]:.2f}x",
                     f"{difference(row.weights, reference.weights):.1e}", row.note]
        else:
            cells = [row.name, "", "", "", "", row.note]
        out.add_row(*cells)
        text.append(cells)
    harmony = rates.get("harmony host step", 0)
    ratios = [f"harmony/torch-default = {harmony / rates[reference.name]:.2f}"]
    if "deepspeed CPUAdam" in rates:
        ratios.append(f"harmony/deepspeed = {harmony / rates['deepspeed CPUAdam']:.2f}")
    return out, text, ratios


def markdown(text: list[list[str]], command: str, threads: int, numel: int, tensors: int, ratios: list[str],
             load: float) -> str:
    header = ["implementation", "M params/s", "ms / step", "vs torch default", "difference from torch default",
              "notes"]
    lines = [
        "# Host optimizer step",
        "",
        f"Measured {datetime.date.today().isoformat()} on torch {torch.__version__}, "
        f"{torch.backends.cpu.get_cpu_capability()}: `{command}` ({numel / 1e6:.2f} M float32 parameters in "
        f"{tensors} tensors, AdamW, {threads} thread{'s' if threads > 1 else ''}; load average "
        f"{load:.1f} when it started, on {os.cpu_count()} cores: other work shares the machine)",
        "",
        "| " + " | ".join(header) + " |",
        "|---|" + "---:|" * (len(header) - 2) + "---|",
        *("| " + " | ".join(cells) + " |" for cells in text),
        "",
        *(f"{line}  " for line in ratios),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=1, help="transformer blocks in the pack")
    parser.add_argument("--width", type=int, default=768, help="the blocks' hidden size")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every row")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, help="write the table as markdown here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    load = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    shapes = block_shapes(args.width, args.blocks)
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(s, generator=generator) * 0.02 for s in shapes.values()]
    grads = [torch.randn(s, generator=generator) * 1e-3 for s in shapes.values()]
    numel = sum(w.numel() for w in weights)
    rows = [harmony_row(shapes, weights, grads),
            torch_row("torch default", weights, grads, "AdamW as built: the single-tensor loop"),
            torch_row("torch foreach", weights, grads, "foreach=True", foreach=True),
            torch_row("torch fused", weights, grads, "fused=True: the kernel Harmony's step runs", fused=True),
            deepspeed_row(weights, grads)]
    measure(rows, args.rounds)
    out, text, ratios = table(rows, numel)
    console = Console(width=200)
    console.print(out)
    for line in ratios:
        console.print(line)
    if args.out is not None:
        command = " ".join(["python -m bench.host_step", *(sys.argv[1:] if argv is None else argv)])
        args.out.write_text(markdown(text, command, args.threads, numel, len(shapes), ratios, load))


if __name__ == "__main__":
    main()
