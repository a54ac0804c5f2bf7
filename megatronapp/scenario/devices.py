"""Named devices: spec-sheet numbers and the efficiency constants fitted for them.

``cluster.gpu: h100-sxm`` (or ``cluster.gpu: {device: h100-sxm, ...}``) fills
the GPU's peak, memory and HBM bandwidth and the node's NVLink and
InfiniBand bandwidths from the profile below; keys the scenario gives
itself win. Rates are dense bf16 TFLOP/s, GB, TB/s, and Gbit/s per direction
per GPU (the unit of ``cluster.links``); ``sm_count`` is the GPU's streaming
multiprocessors (GEMM waves, megatronapp/costs/gemm.py). The efficiency
constants fitted for a device are data, ``device_fits.yaml`` beside this
file, written by ``paper_figs/fit_devices.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..io import gate
from ..io.text import load_yaml

FITS_FILE = Path(__file__).with_name("device_fits.yaml")
KERNELS_DIR = Path(__file__).with_name("kernels")  # measured kernel times, by device


@dataclass(frozen=True)
class DeviceProfile:
    gpu: dict[str, float | str]  # cluster.gpu keys
    links: dict[str, float | int]  # cluster.links keys
    # Efficiency-model constants fitted on published runs (docs/fidelity.md,
    # paper_figs/fit_devices.py); empty where no published row was fitted.
    fitted: dict[str, float] = field(default_factory=dict)
    fitted_on: str = ""


# The analytic GEMM model's constants fitted on the 369 GEMMs measured on an H100
# (``paper_figs/kernel_bench.py compare``, with the model's tiles).
HOPPER_GEMM_MODEL = {"efficiency": 0.71, "gemm_half_gflops": 1.0}

SPECS: dict[str, DeviceProfile] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): 312 TFLOP/s bf16 dense,
    # 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s (300 per direction);
    # DGX A100 datasheet: eight 200 Gb/s HDR InfiniBand compute NICs.
    # 108 SMs (NVIDIA A100 Tensor Core GPU Architecture whitepaper).
    "a100-80gb": DeviceProfile(
        gpu={"tflops": 312.0, "memory_gb": 80.0, "hbm_tbps": 2.039, "sm_count": 108},
        links={"intra_node_gbps": 2400.0, "inter_node_gbps": 200.0, "nics_per_node": 8}),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOP/s bf16 dense,
    # 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s (450 per direction);
    # DGX H100 datasheet: eight 400 Gb/s NDR InfiniBand (ConnectX-7) NICs.
    # 132 SMs (NVIDIA H100 Tensor Core GPU Architecture whitepaper, SXM5).
    # GEMMs, attention and element-wise kernels as measured on one H100 80GB HBM3
    # (kernels/h100-sxm.json, paper_figs/kernel_bench.py); the analytic GEMM model,
    # for what the table does not price, with its constants fitted on those GEMMs.
    "h100-sxm": DeviceProfile(
        gpu={"tflops": 989.0, "memory_gb": 80.0, "hbm_tbps": 3.35, "sm_count": 132,
             "kernels": "h100-sxm", **HOPPER_GEMM_MODEL},
        links={"intra_node_gbps": 3600.0, "inter_node_gbps": 400.0, "nics_per_node": 8}),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): 989 TFLOP/s bf16 dense,
    # 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; DGX H200: eight 400 Gb/s NDR NICs.
    # Kernels as measured on one H200 (kernels/h200-sxm.json, the same script):
    # GEMMs and attention within 2% of the H100's (the same SMs), element-wise
    # work up to 1.4x faster (its HBM). The H100's fit carries over (SHARED_FITS).
    "h200": DeviceProfile(
        gpu={"tflops": 989.0, "memory_gb": 141.0, "hbm_tbps": 4.8, "sm_count": 132,
             "kernels": "h200-sxm", **HOPPER_GEMM_MODEL},
        links={"intra_node_gbps": 3600.0, "inter_node_gbps": 400.0, "nics_per_node": 8}),
}


def load_fits(path: Path = FITS_FILE) -> dict[str, dict[str, Any]]:
    """Each device's fitted constants and the rows they were fitted on."""
    fits = load_yaml(gate.read_text(path, "", gate.MAX_TEXT_BYTES), str(path))
    return fits if isinstance(fits, dict) else {}


# A device without published rows of its own that takes another's fit: the
# H200 has the H100's SMs and clocks, so what a step adds to its measured
# kernels (kernel_time_factor) and the element-wise traffic carry over.
SHARED_FITS = {"h200": "h100-sxm"}


def with_fits(specs: dict[str, DeviceProfile],
              fits: dict[str, dict[str, Any]]) -> dict[str, DeviceProfile]:
    """The profiles with their fitted constants (a device without a fit keeps none)."""
    def fit_of(name: str) -> dict[str, Any]:
        return fits.get(SHARED_FITS.get(name, name), {})

    return {name: DeviceProfile(p.gpu, p.links, dict(fit_of(name).get("constants", {})),
                                str(fit_of(name).get("fitted_on", "")))
            for name, p in specs.items()}


DEVICES = with_fits(SPECS, load_fits())


def expand_device(cluster: dict[str, Any], profile: DeviceProfile) -> dict[str, Any]:
    """``cluster`` (a scenario's raw mapping) with the profile's values under
    the keys it does not set itself; ``gpu.device`` removed."""
    gpu = {k: v for k, v in cluster["gpu"].items() if k != "device"}
    links = cluster.get("links") or {}
    return {**cluster,
            "gpu": {**profile.gpu, **profile.fitted, **gpu},
            "links": {**profile.links, **links}}
