"""The GPUs a user is likely to train on, as data: memory, HBM bandwidth, dense bf16 and fp8 FLOP/s and
the interconnect per GPU, each from its maker's public datasheet (`DEVICES`); the GPU a run is on,
recognised by its CUDA name with its memory read from CUDA (`visible`); and the rule that scales a
time measured on one GPU to another (`scaled_seconds`: a roofline of the counted work, launches held).
The table, its sources and the rule: docs/gpu-runs.md, "Devices".

    python bench/gpu_report.py --dry_run --device h200     # plan and predict a GPU that is not here
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

from t2ibench.core.errors import fail

GIB = 2**30
# The GPU every measurement of this project so far ran on (results/h100-*): predictions scale from it.
REFERENCE_DEVICE = "h100-sxm"


@dataclasses.dataclass(frozen=True)
class Device:
    """One GPU model. FLOP/s are dense (the datasheets' "with sparsity" figures halved); the link is what
    one GPU sends per direction to the others of its node (NVLink, Infinity Fabric or PCIe)."""

    key: str  # --device's value
    label: str  # in tables and reports
    cuda_names: tuple[str, ...]  # lower-case parts of torch.cuda.get_device_name that recognise it
    memory_bytes: float  # HBM as published
    cuda_memory_gib: float  # what torch.cuda.get_device_properties(0).total_memory reports, GiB
    cuda_memory_seen: bool  # True: read on one here; False: the published size less the H100's gap, unchecked
    hbm_bytes_per_sec: float
    bf16_flops_per_sec: float | None  # None: unknown (a GPU outside the table)
    fp8_flops_per_sec: float | None  # None: no float8 tensor cores
    link_bytes_per_sec: float  # per direction per GPU, for the collectives
    source: str  # the public document the figures are from
    measured: bool = False  # whether any figure of this project was measured on it

    @property
    def cuda_memory_bytes(self) -> float:
        return self.cuda_memory_gib * GIB

    @property
    def link_gb_per_sec(self) -> float:
        return self.link_bytes_per_sec / 1e9

    def peak_flops_per_sec(self, fp8: bool = False) -> float | None:
        """A matmul's peak: float8's where the op multiplies float8 and the GPU has it, else bf16's."""
        return self.fp8_flops_per_sec if fp8 and self.fp8_flops_per_sec else self.bf16_flops_per_sec


_NVIDIA_H100 = ("NVIDIA H100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h100/ "
                "(H100 SXM / H100 PCIe columns; bf16 1,979 and 1,513, fp8 3,958 and 3,026 TFLOP/s with sparsity)")
DEVICES: dict[str, Device] = {d.key: d for d in (
    # torch reports 79.18 GiB on the H100 SXM of the results/h100-2026-11-25 to 11-27 runs (its OOM message); NVLink 4:
    # 900 GB/s both directions.
    Device("h100-sxm", "H100 80GB", ("h100 80gb hbm3", "h100 sxm", "h100"), 80e9, 79.1, True, 3.35e12,
           989.4e12, 1978.9e12, 450e9, _NVIDIA_H100, measured=True),
    # PCIe cards of a node talk over PCIe Gen5 x16 (128 GB/s both directions); NVLink bridges join pairs only.
    Device("h100-pcie", "H100 PCIe 80GB", ("h100 pcie",), 80e9, 79.1, False, 2.0e12, 756.5e12, 1513e12, 64e9,
           _NVIDIA_H100),
    # The H200 SXM: the H100's GH100 with 141 GB of HBM3e. torch's figure is the one this project has
    # planned with since the memory model (139.8 GiB: the published size less the H100's gap, rounded down).
    Device("h200", "H200 141GB", ("h200",), 141e9, 139.8, False, 4.8e12, 989.4e12, 1978.9e12, 450e9,
           "NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM: "
           "141 GB HBM3e, 4.8 TB/s, bf16 1,979 and fp8 3,958 TFLOP/s with sparsity, NVLink 900 GB/s)"),
    Device("b200", "B200 180GB", ("b200",), 180e9, 178.4, False, 8.0e12, 2.25e15, 4.5e15, 900e9,
           "NVIDIA HGX B200 specifications, https://www.nvidia.com/en-us/data-center/hgx/ and the DGX B200 "
           "datasheet (8 GPUs: 1,440 GB HBM3e, 64 TB/s; FP16/BF16 36 and FP8 72 PFLOP/s with sparsity; "
           "NVLink 5 1.8 TB/s per GPU)"),
    # "gb200" is matched before "b200" (`recognise` tries the table in order, GB200 listed first below).
    Device("gb200", "GB200 186GB", ("gb200",), 186e9, 184.0, False, 8.0e12, 2.5e15, 5.0e15, 900e9,
           "NVIDIA GB200 NVL72 specifications, https://www.nvidia.com/en-us/data-center/gb200-nvl72/ (72 GPUs: "
           "13.4 TB HBM3e, 576 TB/s; FP16/BF16 360 and FP8 720 PFLOP/s with sparsity; NVLink 130 TB/s)"),
    Device("a100-80gb", "A100 80GB", ("a100-sxm4-80gb", "a100 80gb", "a100-80gb"), 80e9, 79.1, False, 2.039e12,
           312e12, None, 300e9,
           "NVIDIA A100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/a100/ (A100 80GB "
           "SXM: HBM2e 2,039 GB/s, bf16 312 TFLOP/s dense, NVLink 3 600 GB/s; no float8)"),
    Device("a100-40gb", "A100 40GB", ("a100",), 40e9, 39.4, False, 1.555e12, 312e12, None, 300e9,
           "NVIDIA A100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/a100/ (A100 40GB "
           "SXM: HBM2 1,555 GB/s)"),
    # ROCm's torch answers torch.cuda.* for AMD GPUs: "AMD Instinct MI300X". Infinity Fabric: 7 links of
    # 128 GB/s both directions to the node's other 7 GPUs.
    Device("mi300x", "MI300X 192GB", ("mi300x",), 192e9, 191.5, False, 5.3e12, 1307.4e12, 2614.9e12, 448e9,
           "AMD Instinct MI300X data sheet, https://www.amd.com/en/products/accelerators/instinct/mi300/"
           "mi300x.html (192 GB HBM3, 5.3 TB/s, bf16 1,307.4 and fp8 2,614.9 TFLOP/s dense, 896 GB/s "
           "Infinity Fabric peer bandwidth)"),
)}
# Tried in this order by `recognise`: the more specific names first.
_RECOGNITION_ORDER = ("gb200", "b200", "h200", "h100-pcie", "h100-sxm", "a100-80gb", "a100-40gb", "mi300x")
DEVICE_CHOICES = tuple(DEVICES)
# torch.cuda.get_device_properties(0).total_memory by label, GiB: what the memory model plans with.
GPU_MEMORY_GIB = {d.label: d.cuda_memory_gib for d in DEVICES.values()}


def get(key: str, flag: str = "--device") -> Device:
    """The table's device of this key, or one line naming the keys."""
    if key not in DEVICES:
        fail(f"{flag} {key} is not a GPU this project knows: pick one of {', '.join(DEVICES)}")
    return DEVICES[key]


def reference() -> Device:
    """The GPU the project's measurements were taken on (REFERENCE_DEVICE)."""
    return DEVICES[REFERENCE_DEVICE]


def recognise(cuda_name: str) -> Device | None:
    """The table's device whose name torch.cuda.get_device_name gave, or None."""
    name = cuda_name.lower()
    return next((DEVICES[key] for key in _RECOGNITION_ORDER if any(part in name for part in DEVICES[key].cuda_names)),
                None)


def visible(index: int = 0) -> Device:
    """The visible GPU: the table's figures for its name, its memory as CUDA reports it. A GPU the table
    lacks keeps its name and memory; its FLOP/s are unknown and its link taken as the reference's."""
    import torch

    name = torch.cuda.get_device_name(index)
    total_gib = torch.cuda.get_device_properties(index).total_memory / GIB
    known = recognise(name)
    if known is not None:
        return dataclasses.replace(known, cuda_memory_gib=total_gib, cuda_memory_seen=True, measured=True)
    ref = reference()
    return Device("visible", name, (name.lower(),), total_gib * GIB, total_gib, True, ref.hbm_bytes_per_sec, None,
                  None, ref.link_bytes_per_sec, "torch.cuda (not in the table: FLOP/s unknown)", measured=True)


def named_or_visible(key: str | None) -> Device | None:
    """--device's device, else the visible GPU, else None (no GPU and no --device)."""
    if key is not None:
        return get(key)
    import torch

    return visible() if torch.cuda.is_available() else None


# -- scaling a measured time to another GPU ------------------------------------------------------------

# One op of a counted step: (FLOPs, bytes read and written, whether its matmul multiplies float8).
Work = tuple[float, float, bool]


def roofline_seconds(work: Iterable[Work], device: Device) -> float:
    """The step's ops each at the slower of the device's peak FLOP/s and HBM bandwidth, summed."""
    total = 0.0
    for flops, num_bytes, fp8 in work:
        peak = device.peak_flops_per_sec(fp8) or device.bf16_flops_per_sec
        total += max(flops / peak if flops else 0.0, num_bytes / device.hbm_bytes_per_sec)
    return total


def scaled_seconds(measured_seconds: float, source: Device, target: Device, source_work: Iterable[Work],
                   target_work: Iterable[Work] | None = None, fixed_seconds: float = 0.0,
                   target_fixed_seconds: float | None = None) -> float:
    """A time measured on `source`, predicted on `target` (docs/gpu-runs.md, "Devices"): the measured time
    less its fixed part (kernel launches, which the host issues at the same rate on either GPU) scales by
    the ratio of the two roofline times, the counted work of the measured step on `source` against that of
    the predicted step (`target_work`, by default the same) on `target`; the target's own fixed part is added."""
    source_work = list(source_work)
    target_work = source_work if target_work is None else list(target_work)
    busy = max(0.0, measured_seconds - fixed_seconds)
    ratio = roofline_seconds(target_work, target) / roofline_seconds(source_work, source)
    return busy * ratio + (fixed_seconds if target_fixed_seconds is None else target_fixed_seconds)


def table_rows() -> list[str]:
    """The table in Markdown (docs/gpu-runs.md's copy is checked against it)."""
    rows = ["| `--device` | GPU | memory (CUDA) | HBM | bf16 dense | fp8 dense | link per direction | source |",
            "|---|---|---|---|---|---|---|---|"]
    for d in DEVICES.values():
        seen = "" if d.cuda_memory_seen else " est."
        fp8 = f"{d.fp8_flops_per_sec / 1e12:,.0f} TFLOP/s" if d.fp8_flops_per_sec else "none"
        rows.append(f"| `{d.key}` | {d.label} | {d.memory_bytes / 1e9:.0f} GB ({d.cuda_memory_gib:.1f} GiB{seen}) | "
                    f"{d.hbm_bytes_per_sec / 1e12:.2f} TB/s | {d.bf16_flops_per_sec / 1e12:,.0f} TFLOP/s | {fp8} | "
                    f"{d.link_gb_per_sec:.0f} GB/s | {d.source} |")
    return rows
