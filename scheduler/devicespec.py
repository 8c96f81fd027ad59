"""Device descriptions for analytic planning: peak FLOP/s, memory bandwidth, capacity and links.

``harmony compile --analytic SPEC`` plans for hardware we do not have. SPEC is a preset name
(``1080ti``, ``v100``, ``a100``, ``h100`` and a few memory variants) or a JSON file holding the
fields of :class:`DeviceSpec`. Units are SI: FLOP/s, bytes/s, bytes.

Sources of the preset numbers (vendor datasheets and whitepapers; peak numbers are the *dense*
boost-clock figures, i.e. without 2:4 structured sparsity):

- GTX 1080 Ti: NVIDIA GeForce GTX 1080 Ti specifications page: 3584 CUDA cores at 1582 MHz boost
  -> 11.34 TFLOP/s FP32; FP16 and FP64 run at 1/64 and 1/32 of FP32 on GP102 (Pascal GP102
  whitepaper); 11 GB GDDR5X at 484 GB/s.
- V100: NVIDIA Tesla V100 datasheet (SXM2): 15.7 TFLOP/s FP32, 7.8 FP64, 125 FP16 tensor core;
  900 GB/s HBM2; 16 or 32 GB; NVLink 2 300 GB/s aggregate (6 links x 25 GB/s per direction).
- A100: NVIDIA A100 Tensor Core GPU datasheet (SXM4): 19.5 TFLOP/s FP32, 156 TF32 tensor,
  312 BF16/FP16 tensor, 9.7 FP64 (19.5 FP64 tensor); 40 GB HBM2 at 1,555 GB/s, 80 GB HBM2e at
  2,039 GB/s; NVLink 3 600 GB/s aggregate (300 GB/s per direction); PCIe 4.0 x16.
- H100: NVIDIA H100 Tensor Core GPU datasheet (SXM5): 67 TFLOP/s FP32, 494.7 TF32 tensor,
  989.4 BF16/FP16 tensor, 34 FP64 (67 FP64 tensor); 80 GB HBM3 at 3.35 TB/s; NVLink 4 900 GB/s
  aggregate (450 GB/s per direction); PCIe 5.0 x16.
- PCIe: 3.0 x16 is 15.75 GB/s per direction in theory and about 12 GB/s for pinned copies in
  practice; 4.0 x16 31.5 -> ~25 GB/s; 5.0 x16 63 -> ~50 GB/s (PCI-SIG spec rates, derated by the
  ~80% that cudaMemcpy with pinned memory reaches in bandwidthTest runs).
- Hosts (for the CPU-side optimizer update): the DGX-1 (2x Xeon E5-2698 v4, 4x DDR4-2400 per
  socket: 154 GB/s), DGX A100 (2x EPYC 7742, 8x DDR4-3200 per socket: 410 GB/s), DGX H100 (2x Xeon
  8480C, 8x DDR5-4800 per socket: 614 GB/s) system datasheets; host FLOP/s are cores x clock x FP32
  FMA width. The 1080 Ti host is a commodity dual-socket Xeon server like the paper's (§5.1).

``host_link_shared`` says whether the devices share one host link (a PCIe switch above several
GPUs, as in the commodity servers of the Harmony paper and the DGX-1's PCIe tree, where two V100s
share one x16 uplink) so that swaps of different devices contend; DGX A100/H100 give every GPU its
own x16 link, so those presets say False.

Capacities are the nominal GiB (the CUDA context and allocator reserve a few hundred MiB more in
practice; lower ``capacity`` in a JSON spec to model that).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from harmony.errors import HarmonyError

GB = 10**9
GiB = 1 << 30
TFLOPS = 10**12


class DeviceSpecError(HarmonyError):
    """A device spec name or file that cannot be used."""


@dataclass
class DeviceSpec:
    """One accelerator (and its host) as the analytic profiler and estimator see it.

    ``peak_flops`` is the dense peak at the spec's default training dtype (float32 for every
    preset); ``dtype_flops`` gives the peaks of other dtypes by name (``"bfloat16"``, ``"float16"``,
    ``"float64"``, ...), read through :meth:`flops_for`. ``efficiency`` is the fraction of the compute
    peak that real kernels reach.
    """

    name: str
    peak_flops: float  # FLOP/s at the training dtype (float32), dense
    memory_bandwidth: float  # device memory, B/s
    capacity: int  # device memory, bytes
    host_to_device: float  # B/s, effective (pinned)
    device_to_host: float  # B/s, effective (pinned)
    device_to_device: float  # B/s, p2p between two devices, one direction
    host_link_shared: bool  # whether all devices share one host link
    host_flops: float  # FLOP/s of the host CPU(s), for the CPU-side optimizer update
    host_memory_bandwidth: float  # B/s of host memory
    efficiency: float = 0.5  # fraction of the compute peak reached by real kernels
    dtype_flops: dict[str, float] = field(default_factory=dict)  # dtype name -> dense peak FLOP/s

    def __post_init__(self) -> None:
        problems = []
        for f in ("peak_flops", "memory_bandwidth", "capacity", "host_to_device", "device_to_host",
                  "device_to_device", "host_flops", "host_memory_bandwidth"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                problems.append(f"{f} must be a positive number, got {value!r}")
        if isinstance(self.efficiency, bool) or not isinstance(self.efficiency, (int, float)) or not 0 < self.efficiency <= 1:
            problems.append(f"efficiency must be in (0, 1], got {self.efficiency!r}")
        if not isinstance(self.host_link_shared, bool):
            problems.append(f"host_link_shared must be true or false, got {self.host_link_shared!r}")
        if not isinstance(self.dtype_flops, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in self.dtype_flops.values()
        ):
            problems.append(f"dtype_flops must map dtype names to positive FLOP/s, got {self.dtype_flops!r}")
        if problems:
            raise DeviceSpecError(f"device spec {self.name!r}: " + "; ".join(problems))
        self.capacity = int(self.capacity)
        self.dtype_flops = {_dtype_name(k): float(v) for k, v in self.dtype_flops.items()}

    def flops_for(self, dtype: torch.dtype | str | None = None) -> float:
        """Dense peak FLOP/s for arithmetic in ``dtype`` (default: the spec's ``peak_flops``)."""
        if dtype is None:
            return float(self.peak_flops)
        return float(self.dtype_flops.get(_dtype_name(dtype), self.peak_flops))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, body: dict[str, Any], source: str = "device spec") -> "DeviceSpec":
        if not isinstance(body, dict):
            raise DeviceSpecError(f"{source} must be a JSON object with the fields {', '.join(FIELD_NAMES)}")
        known = set(FIELD_NAMES)
        unknown = sorted(set(body) - known)
        required = [f.name for f in fields(cls) if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [f for f in required if f not in body]
        if unknown or missing:
            parts = []
            if missing:
                parts.append(f"missing field(s) {', '.join(missing)}")
            if unknown:
                parts.append(f"unknown field(s) {', '.join(unknown)}")
            raise DeviceSpecError(f"{source}: {'; '.join(parts)}. A device spec has the fields {', '.join(FIELD_NAMES)}")
        return cls(**body)


FIELD_NAMES = tuple(f.name for f in fields(DeviceSpec))


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def _dtypes(fp32: float, tf32: float | None, half: float, bf16: float | None, fp64: float) -> dict[str, float]:
    out = {"float32": fp32 * TFLOPS, "float16": half * TFLOPS, "float64": fp64 * TFLOPS}
    if tf32 is not None:
        out["tfloat32"] = tf32 * TFLOPS  # float32 matmuls with torch.backends.cuda.matmul.allow_tf32
    if bf16 is not None:
        out["bfloat16"] = bf16 * TFLOPS
    return out


def _gtx_1080ti() -> DeviceSpec:
    return DeviceSpec(
        name="1080ti", peak_flops=11.34 * TFLOPS, memory_bandwidth=484 * GB, capacity=11 * GiB,
        host_to_device=12 * GB, device_to_host=12 * GB,  # PCIe 3.0 x16, pinned
        device_to_device=10 * GB,  # p2p through the PCIe switch
        host_link_shared=True,  # commodity server: GPUs behind one PCIe switch / root port
        host_flops=1.0 * TFLOPS, host_memory_bandwidth=100 * GB,  # dual Xeon, DDR4
        efficiency=0.5,
        # GP102 has no tensor cores: FP16 at 1/64 rate, FP64 at 1/32 rate; no BF16.
        dtype_flops=_dtypes(11.34, None, 11.34 / 64, None, 11.34 / 32),
    )


def _v100(capacity_gib: int, name: str) -> DeviceSpec:
    return DeviceSpec(
        name=name, peak_flops=15.7 * TFLOPS, memory_bandwidth=900 * GB, capacity=capacity_gib * GiB,
        host_to_device=12 * GB, device_to_host=12 * GB,  # PCIe 3.0 x16
        device_to_device=50 * GB,  # NVLink 2, two links of 25 GB/s per direction (DGX-1 cube mesh)
        host_link_shared=True,  # DGX-1: two GPUs per PCIe switch uplink
        host_flops=2.5 * TFLOPS, host_memory_bandwidth=154 * GB,
        efficiency=0.5,
        # FP16 on tensor cores; Volta has no BF16 or TF32.
        dtype_flops=_dtypes(15.7, None, 125.0, None, 7.8),
    )


def _a100(capacity_gib: int, bandwidth: float, name: str) -> DeviceSpec:
    return DeviceSpec(
        name=name, peak_flops=19.5 * TFLOPS, memory_bandwidth=bandwidth, capacity=capacity_gib * GiB,
        host_to_device=25 * GB, device_to_host=25 * GB,  # PCIe 4.0 x16
        device_to_device=300 * GB,  # NVLink 3, per direction
        host_link_shared=False,
        host_flops=9.0 * TFLOPS, host_memory_bandwidth=410 * GB,
        efficiency=0.5,
        dtype_flops=_dtypes(19.5, 156.0, 312.0, 312.0, 19.5),
    )


def _h100() -> DeviceSpec:
    return DeviceSpec(
        name="h100", peak_flops=67 * TFLOPS, memory_bandwidth=3350 * GB, capacity=80 * GiB,
        host_to_device=50 * GB, device_to_host=50 * GB,  # PCIe 5.0 x16
        device_to_device=450 * GB,  # NVLink 4, per direction
        host_link_shared=False,
        host_flops=14.0 * TFLOPS, host_memory_bandwidth=614 * GB,
        efficiency=0.5,
        dtype_flops=_dtypes(67.0, 494.7, 989.4, 989.4, 67.0),
    )


PRESETS: dict[str, Any] = {
    "1080ti": _gtx_1080ti,
    "v100": lambda: _v100(16, "v100"),
    "v100-32gb": lambda: _v100(32, "v100-32gb"),
    "a100": lambda: _a100(40, 1555 * GB, "a100"),
    "a100-80gb": lambda: _a100(80, 2039 * GB, "a100-80gb"),
    "h100": _h100,
}


def preset(name: str) -> DeviceSpec:
    """A fresh copy of a preset (callers may change its fields)."""
    key = name.strip().lower()
    if key not in PRESETS:
        raise DeviceSpecError(f"unknown device spec {name!r}; choose one of {', '.join(PRESETS)} or give a JSON file")
    return PRESETS[key]()


def load_spec(name_or_path: str | Path | DeviceSpec) -> DeviceSpec:
    """A preset by name, or a JSON file with the fields of :class:`DeviceSpec`."""
    if isinstance(name_or_path, DeviceSpec):
        return name_or_path
    text = str(name_or_path)
    if text.strip().lower() in PRESETS:
        return preset(text)
    path = Path(text)
    if not path.is_file():
        raise DeviceSpecError(
            f"{text!r} is neither a device spec preset ({', '.join(PRESETS)}) nor an existing JSON file"
        )
    try:
        body = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DeviceSpecError(f"device spec file {path} is not valid JSON: {exc}") from exc
    if isinstance(body, dict) and "name" not in body:
        body = {"name": path.stem, **body}
    return DeviceSpec.from_dict(body, source=f"device spec file {path}")


def save_spec(spec: DeviceSpec, path: str | Path) -> None:
    Path(path).write_text(json.dumps(spec.to_dict(), indent=2, sort_keys=True) + "\n")
