"""DeepSpeed ZeRO-3 with parameters and optimizer state offloaded to host memory (ZeRO-Offload /
ZeRO-Infinity to CPU), run as a peer next to Harmony: same model file, same device-memory cap, same
minibatch and microbatch.

ZeRO-3 offload is the standard answer to "the model does not fit on the GPU": every parameter and
the Adam state live in pinned host memory, parameters are fetched layer by layer for the forward
and backward passes, gradients go back to the host as they are produced, and the host steps the
optimizer. It is the baseline Harmony's swapping has to beat on one GPU.

    python -m bench.deepspeed_peer --model models/gpt2.py --arg preset=medium \\
        --minibatch 16 --microbatch 4 --device-memory 6GiB --iters 6 --precision bf16 --json out.json

It needs a CUDA GPU and DeepSpeed. The GPU machine has no registry, so DeepSpeed travels as wheels
that ``bash bench/gpu_wheels.sh`` writes to ``.whl/``; install them there with

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site

Without either, the command exits with status 2 and says what is missing. Not fitting under the cap
is a result, not a crash: the JSON then has "error" (CUDA out of memory) and the status is 1.
``zero_offload_config`` needs neither (it only builds a dict), so the tests check it everywhere.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SYSTEM = "deepspeed-zero3-offload"
EXIT_MISSING = 2
INSTALL_LINE = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
                "--target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site")

# ZeRO-3 sizes, counted in parameter elements (bf16: 2 bytes each, fp32: 4). DeepSpeed's defaults
# (5e8-element buckets, 1e9 live parameters) are set for whole 40-80 GB GPUs: under a cap of a few
# GiB those buffers alone would take most of it, and the point of the peer is to run in the same cap
# as Harmony. Each number is the smallest that keeps a GPT-2 block (12 d^2: 12.6M elements for
# GPT-2 medium, 31M for 1.5B) moving as one piece, so the device is not starved by tiny transfers.
REDUCE_BUCKET = 50_000_000
"""Gradients gathered before one reduce + copy to the host: 100 MB in bf16, 200 MB in fp32; with
overlap_comm two buckets are in flight, so at most 400 MB of a fp32 run's cap."""
PREFETCH_BUCKET = 50_000_000
"""Parameters fetched ahead of the layer that needs them: about one 1.5B block (two medium blocks),
enough to hide the host-to-device copy behind the current block's compute."""
MAX_LIVE = 100_000_000
"""Most parameter elements gathered on the device at once (200 MB bf16): room for the current block,
the prefetched one and the largest single tensor of the presets up to 1.5B (the tied 80M-element
token embedding, 50257 x 1600), which is fetched whole whatever the limit."""
MAX_REUSE = 100_000_000
"""A released parameter used again within this many fetched elements is kept on the device instead
of fetched again; small, so that the forward's blocks are not all kept for the backward."""
PERSISTENCE = 100_000
"""Tensors smaller than this (biases, LayerNorm weights: under 1 MB in all for GPT-2 medium) stay on
the device: fetching them one by one would cost more in latency than they take in memory."""
SUB_GROUP = 100_000_000
"""The host optimizer steps the fp32 master weights in groups of this many elements (1.2 GB of fp32
weights and Adam moments per group): bounds the pinned staging memory without a step per tensor."""


class MissingRequirement(RuntimeError):
    """What the run needs and this machine lacks (a CUDA GPU, DeepSpeed), in one line."""


def zero_offload_config(micro_batch: int, grad_accum: int, precision: str, lr: float = 1e-4,
                        cpu_adam: bool = True) -> dict[str, Any]:
    """The DeepSpeed config of a ZeRO-3 run with parameters and optimizer state in pinned host memory.

    Adam as Harmony's model files build it (betas 0.9/0.999, eps 1e-8, no weight decay, no gradient
    clipping). ``cpu_adam=True`` lets DeepSpeed step it with its vectorised DeepSpeedCPUAdam (a C++
    op built on first use); ``cpu_adam=False`` makes it use ``torch.optim.Adam`` on the host
    (``torch_adam``), for a machine where that op does not build. ``precision``: "bf16" (bf16
    weights and activations, fp32 master weights and moments on the host) or "fp32"; fp16 would
    need loss scaling, which Harmony's runs do not use, so it is refused.
    """
    if micro_batch < 1 or grad_accum < 1:
        raise ValueError(f"micro_batch and grad_accum must be at least 1, got {micro_batch} and {grad_accum}")
    if precision == "fp16":
        raise ValueError("precision 'fp16' is not supported by the DeepSpeed peer: it needs dynamic loss "
                         "scaling, which the Harmony runs it is compared with do not use; use 'bf16' or 'fp32'")
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision must be 'bf16' or 'fp32', got {precision!r}")
    adam: dict[str, Any] = {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                            "adam_w_mode": False}  # plain Adam, as torch.optim.Adam
    if not cpu_adam:
        adam["torch_adam"] = True
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "optimizer": {"type": "Adam", "params": adam},
        # DeepSpeed insists on its own CPU optimizer under offload unless told otherwise; with
        # torch's Adam chosen on purpose, it is told.
        "zero_force_ds_cpu_optimizer": cpu_adam,
        "gradient_clipping": 0.0,  # 0: no clipping, as in the Harmony runs
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": False},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            # Copies gradients to the host on a side stream while the backward goes on; the
            # price is a second reduce bucket (counted in REDUCE_BUCKET's budget).
            "overlap_comm": True,
            "contiguous_gradients": True,  # one flat gradient buffer: no fragmentation under the cap
            "reduce_bucket_size": REDUCE_BUCKET,
            "stage3_prefetch_bucket_size": PREFETCH_BUCKET,
            "stage3_param_persistence_threshold": PERSISTENCE,
            "stage3_max_live_parameters": MAX_LIVE,
            "stage3_max_reuse_distance": MAX_REUSE,
            "sub_group_size": SUB_GROUP,
            "stage3_gather_16bit_weights_on_model_save": False,
        },
        "steps_per_print": 10**9,  # DeepSpeed's own progress lines would interleave with the result
        "wall_clock_breakdown": False,
    }


def missing_requirements(device: str = "cuda") -> list[str]:
    """What this machine lacks for ``run``: one sentence per missing piece, saying how to get it.

    Looks without importing DeepSpeed (an import takes seconds and reads the accelerator)."""
    missing = []
    if importlib.util.find_spec("deepspeed") is None:
        missing.append("DeepSpeed is not installed: on a machine with PyPI run `bash bench/gpu_wheels.sh` (writes "
                       f".whl/), carry .whl to the GPU machine and run there `{INSTALL_LINE}`")
    if device == "cuda" and not torch.cuda.is_available():
        missing.append(f"no CUDA GPU: torch {torch.__version__} sees none (torch.cuda.is_available() is False); "
                       "run this on the GPU machine")
    return missing


def _single_process_env() -> None:
    """A one-process "world" for torch.distributed, which DeepSpeed needs even on one GPU."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        from bench.common import free_port

        os.environ["MASTER_PORT"] = str(free_port())


def load_cpu_adam() -> tuple[bool, str | None, float]:
    """Build (JIT, with ninja and the host compiler) or load DeepSpeed's CPU Adam op.

    Returns (loaded, why not, seconds). Built here rather than inside ``deepspeed.initialize`` so
    that a failure falls back to torch's Adam with its reason recorded, and the build time is kept
    out of the timed iterations."""
    start = time.perf_counter()
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load()
    except Exception as exc:  # noqa: BLE001 - any failure to build means: use torch's Adam
        return False, f"{type(exc).__name__}: {exc}".strip(), time.perf_counter() - start
    return True, None, time.perf_counter() - start


def _is_oom(exc: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return isinstance(exc, oom) or "out of memory" in str(exc).lower()


def _split(obj: Any, parts: int) -> list[Any]:
    """A batch (tensor, or tuple/list/dict of them) cut along its first dimension into ``parts``."""
    if isinstance(obj, torch.Tensor):
        return list(obj.tensor_split(parts))
    if isinstance(obj, (tuple, list)):
        return [type(obj)(items) for items in zip(*(_split(o, parts) for o in obj))]
    if isinstance(obj, dict):
        cut = {k: _split(v, parts) for k, v in obj.items()}
        return [{k: v[i] for k, v in cut.items()} for i in range(parts)]
    return [obj] * parts


def _to(obj: Any, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    """``obj`` moved to ``device``, floating-point tensors cast to ``dtype`` (bf16 weights take bf16
    inputs: DeepSpeed runs the whole model in the weights' dtype, not under autocast)."""
    if isinstance(obj, torch.Tensor):
        if dtype is not None and obj.is_floating_point():
            return obj.to(device=device, dtype=dtype, non_blocking=True)
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to(o, device, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device, dtype) for k, v in obj.items()}
    return obj


def _call(model, inputs):
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(inputs)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(model_file: str, options: dict, minibatch: int, microbatch: int, device_memory: int, iters: int,
        precision: str, lr: float = 1e-4, cpu_adam: bool = True, *, _device: str = "cuda") -> dict[str, Any]:
    """Train the model file's model with ZeRO-3 offload for ``iters`` minibatches on GPU 0, capped
    at ``device_memory`` bytes, and say how fast and how much memory it took.

    Each minibatch (the model file's ``get_batch(minibatch, step)``, the batches Harmony trains on)
    is cut into ``minibatch // microbatch`` micro-steps of forward, ``engine.backward`` and
    ``engine.step``; DeepSpeed averages their gradients and steps the host optimizer at the last.
    A CUDA out-of-memory anywhere gives a dict with "error" rather than a traceback: not fitting in
    the cap is a result. ``_device="cpu"`` runs it on DeepSpeed's CPU accelerator (gloo, no cap), a
    check of this loop on machines without a GPU, not a benchmark.
    """
    if minibatch % microbatch:
        raise ValueError(f"minibatch {minibatch} is not a multiple of microbatch {microbatch}")
    missing = missing_requirements(_device)
    if missing:
        raise MissingRequirement("; ".join(missing))
    if _device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"  # read when deepspeed is first imported
    _single_process_env()
    result: dict[str, Any] = {"system": SYSTEM, "model_file": str(model_file), "options": dict(options),
                              "minibatch": minibatch, "microbatch": microbatch, "precision": precision,
                              "device_memory": device_memory, "iters": iters, "torch": torch.__version__}
    try:
        _run(result, model_file, options, minibatch, microbatch, device_memory, iters, precision, lr, cpu_adam,
             _device)
    except Exception as exc:
        if not _is_oom(exc):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        what = "CUDA out of memory" if isinstance(exc, torch.cuda.OutOfMemoryError) else "out of memory"
        result["error"] = f"{what} ({type(exc).__name__}) under a cap of {device_memory} bytes: {first}"
        log.warning("%s", result["error"])
    finally:
        _shutdown()
    return result


def _run(result: dict[str, Any], model_file: str, options: dict, minibatch: int, microbatch: int,
         device_memory: int, iters: int, precision: str, lr: float, cpu_adam: bool, device_kind: str) -> None:
    """``run``'s body; fills ``result`` as it goes, so that an out-of-memory keeps what was learned."""
    import deepspeed

    from harmony.modelfile import load_model_file

    result["deepspeed"] = deepspeed.__version__
    if not log.isEnabledFor(logging.INFO):
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its info lines would bury the result
    # DeepSpeed calls torch.distributed APIs that newer torch deprecates, once per micro-step.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    if device_kind == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        props = torch.cuda.get_device_properties(0)
        result["device"] = props.name
        result["device_total_memory"] = props.total_memory
        fraction = min(1.0, device_memory / props.total_memory)
        # The caching allocator refuses to hold more than this share of the GPU; DeepSpeed's own
        # allocations go through it too (NCCL's and the CUDA context's do not, as for Harmony).
        torch.cuda.set_per_process_memory_fraction(fraction, 0)
        result["memory_fraction"] = fraction
        backend = "nccl"
    else:
        device = torch.device("cpu")
        result["device"] = "cpu (DeepSpeed CPU accelerator; a check, not a benchmark)"
        backend = "gloo"
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)

    why_not = "cpu_adam=False was asked for"
    build_s = 0.0
    if cpu_adam:
        cpu_adam, why_not, build_s = load_cpu_adam()
        if not cpu_adam:
            log.warning("DeepSpeedCPUAdam did not build, using torch.optim.Adam: %s", why_not)
    result["cpu_adam_build_s"] = build_s
    accum = minibatch // microbatch
    config = zero_offload_config(microbatch, accum, precision, lr=lr, cpu_adam=cpu_adam)
    result["config"] = config

    setup = time.perf_counter()
    mf = load_model_file(model_file, options)
    torch.manual_seed(0)
    model = mf.build_model()  # on the host, with the model's own initialisation over whole tensors
    dtype = torch.bfloat16 if precision == "bf16" else None
    if dtype is not None:
        model = model.to(dtype)  # what zero.Init would create under bf16: the weights DeepSpeed computes with
    # Partition the built model as if it had been built under zero.Init: tensor by tensor to the
    # device and back to pinned host memory, so the whole model is never on the capped GPU (the
    # engine moves a model that is not partitioned to the device whole). Building it inside the
    # zero.Init context instead would run a model's whole-model initialisation (GPT-2's
    # reset_parameters) on already-partitioned, empty tensors, silently keeping torch's defaults.
    deepspeed.zero.Init(module=model, config_dict_or_path=config, remote_device="cpu",
                        pin_memory=device_kind == "cuda")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    result["setup_s"] = time.perf_counter() - setup
    basic = type(engine.basic_optimizer)
    result["optimizer"] = ("DeepSpeedCPUAdam" if basic.__name__ == "DeepSpeedCPUAdam"
                           else f"{basic.__module__}.{basic.__qualname__}".replace("torch.optim.adam.", "torch.optim."))
    if result["optimizer"] != "DeepSpeedCPUAdam":
        result["cpu_adam_not_used_because"] = why_not
    result["engine_optimizer"] = type(engine.optimizer).__name__
    if device_kind == "cuda":
        result["setup_max_memory_allocated"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()

    engine.train()
    times: list[float] = []
    losses: list[float] = []
    for step in range(iters):
        seconds, mean_loss = _iteration(engine, mf, step, minibatch, accum, device, dtype, device_kind)
        times.append(seconds)
        losses.append(mean_loss)
        log.info("iteration %d: %.3f s, loss %.4f", step, seconds, mean_loss)
    if device_kind == "cuda":
        _count_copies(result, engine, mf, iters, minibatch, accum, device, dtype)
    steady = times[1:] or times
    result.update(iteration_s=times, losses=losses, micro_steps=accum, optimizer_steps=engine.global_steps,
                  samples_per_s=minibatch / statistics.median(steady) if steady else None)
    if device_kind == "cuda":
        result["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        result["max_memory_reserved"] = torch.cuda.max_memory_reserved()
    else:
        result["max_memory_allocated"] = result["max_memory_reserved"] = None


def _iteration(engine, mf, step: int, minibatch: int, accum: int, device: torch.device, dtype, device_kind: str
               ) -> tuple[float, float]:
    """One minibatch as ``accum`` micro-steps: (seconds, mean loss)."""
    inputs, target = mf.get_batch(minibatch, step)  # made outside the timing, as Harmony's runs do
    pieces = list(zip(_split(inputs, accum), _split(target, accum)))
    _sync(device_kind)
    start = time.perf_counter()
    total = None
    for x, y in pieces:
        output = _call(engine, _to(x, device, dtype))
        loss = mf.loss_fn(output, _to(y, device))
        engine.backward(loss)  # scales by 1 / gradient_accumulation_steps itself
        engine.step()  # the host Adam step at the accumulation boundary, bookkeeping otherwise
        total = loss.detach().float() if total is None else total + loss.detach().float()
    mean_loss = (total / accum).item()
    _sync(device_kind)
    return time.perf_counter() - start, mean_loss


def _count_copies(result: dict[str, Any], engine, mf, step: int, minibatch: int, accum: int,
                  device: torch.device, dtype) -> None:
    """The host<->device bytes of one more iteration, read from a torch.profiler trace (the
    profiler slows it, so it is not one of the timed ones): what the bound of DeepSpeed's own
    traffic is computed from, and how much of it was pageable."""
    from bench.bound import CopyCounter

    with CopyCounter() as copies:
        _iteration(engine, mf, step, minibatch, accum, device, dtype, "cuda")
    result.update(bytes_in=copies.totals["HtoD"], bytes_out=copies.totals["DtoH"],
                  pageable_bytes=copies.totals["HtoD pageable"] + copies.totals["DtoH pageable"])


def _shutdown() -> None:
    """Leave the process group, so that a second ``run`` in the same process can start one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.deepspeed_peer", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model file (build_model, loss_fn, get_batch), e.g. models/gpt2.py")
    parser.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                        help="an option for the model file's functions, repeatable (e.g. --arg preset=medium)")
    parser.add_argument("--minibatch", type=int, default=16, help="samples per iteration (default 16)")
    parser.add_argument("--microbatch", type=int, default=4,
                        help="samples per micro-step; the minibatch is minibatch/microbatch micro-steps (default 4)")
    parser.add_argument("--device-memory", default="6GiB",
                        help="GPU memory cap, e.g. 6GiB or 8000MB (default 6GiB), set with "
                             "torch.cuda.set_per_process_memory_fraction")
    parser.add_argument("--iters", type=int, default=6, help="timed iterations; the first is left out of samples/s (default 6)")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16", help="default bf16")
    parser.add_argument("--lr", type=float, default=1e-4, help="Adam's learning rate (default 1e-4)")
    parser.add_argument("--torch-adam", action="store_true",
                        help="step with torch.optim.Adam on the host instead of DeepSpeedCPUAdam")
    parser.add_argument("--json", type=Path, help="also write the result to this file")
    parser.add_argument("--verbose", action="store_true", help="log each iteration and DeepSpeed's own info")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if ns.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if ns.minibatch < 1 or ns.microbatch < 1 or ns.minibatch % ns.microbatch:
        parser.error(f"--minibatch {ns.minibatch} must be a positive multiple of --microbatch {ns.microbatch}")
    if ns.iters < 1:
        parser.error("--iters must be at least 1")
    from harmony.runtime.device import parse_bytes  # here: the peer imports nothing of ours it does not use

    try:
        cap = parse_bytes(ns.device_memory)
    except ValueError as exc:
        parser.error(f"--device-memory: {exc}")
    missing = missing_requirements("cuda")
    if missing:
        print(f"deepspeed_peer: cannot run: {'; '.join(missing)}", file=sys.stderr)
        return EXIT_MISSING
    from harmony.modelfile import parse_options

    result = run(ns.model, parse_options(ns.arg), ns.minibatch, ns.microbatch, cap, ns.iters, ns.precision,
                 lr=ns.lr, cpu_adam=not ns.torch_adam)
    text = json.dumps(result, indent=2)
    if ns.json:
        ns.json.write_text(text + "\n")
    print(text)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
