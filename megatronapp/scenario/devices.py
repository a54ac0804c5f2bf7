"""Named devices: spec-sheet numbers and the efficiency constants fitted for them.

``cluster.gpu: h100-sxm`` (or ``cluster.gpu: {device: h100-sxm, ...}``) fills
the GPU's peak, memory and HBM bandwidth and the node's NVLink and
InfiniBand bandwidths from the profile below; keys the scenario gives
itself win. Rates are dense bf16 TFLOP/s, GB, TB/s, and Gbit/s per direction
per GPU (the unit of ``cluster.links``); ``sm_count`` is the GPU's streaming
multiprocessors (GEMM waves, megatronapp/costs/gemm.py). The efficiency
constants fitted for a device and software generation (``software.py``) are
data, ``device_fits.yaml`` beside this file, written by ``megatronapp fidelity
fit``; ``architecture`` says which attention kernel Transformer Engine picks
there (``megatron_defaults.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..io import gate
from ..io.text import load_yaml
from .software import DEFAULT_SOFTWARE

FITS_FILE = Path(__file__).with_name("device_fits.yaml")
KERNELS_DIR = Path(__file__).with_name("kernels")  # measured kernel times, by device


@dataclass(frozen=True)
class DeviceProfile:
    gpu: dict[str, float | str]  # cluster.gpu keys
    links: dict[str, float | int]  # cluster.links keys
    # Efficiency-model constants fitted on published runs, by software generation
    # (``megatronapp fidelity fit``); empty where no published row was fitted.
    fits: dict[str, "Fit"] = field(default_factory=dict)
    default_software: str = ""  # whose fit serves a generation without rows of its own

    def fit_for(self, software: str) -> "Fit | None":
        """The fit of ``software`` on this device, else the default generation's."""
        return self.fits.get(software) or self.fits.get(self.default_software)

    @property
    def fitted(self) -> dict[str, float]:
        """The default generation's constants."""
        fit = self.fits.get(self.default_software)
        return dict(fit.constants) if fit else {}

    @property
    def fitted_on(self) -> str:
        fit = self.fits.get(self.default_software)
        return fit.fitted_on if fit else ""


# The analytic GEMM model's constants fitted on the 369 GEMMs measured on an H100
# (``experiments/kernel_bench.py compare``, with the model's tiles).
HOPPER_GEMM_MODEL = {"efficiency": 0.71, "gemm_half_gflops": 1.0}

SPECS: dict[str, DeviceProfile] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): 312 TFLOP/s bf16 dense,
    # 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s (300 per direction); the 80 GB are
    # binary, 81,920 MiB (nvidia-smi's memory.total), 85.90 GB here;
    # DGX A100 datasheet: eight 200 Gb/s HDR InfiniBand compute NICs.
    # 108 SMs (NVIDIA A100 Tensor Core GPU Architecture whitepaper).
    "a100-80gb": DeviceProfile(
        gpu={"tflops": 312.0, "memory_gb": 85.90, "hbm_tbps": 2.039, "sm_count": 108,
             "architecture": "ampere"},
        links={"intra_node_gbps": 2400.0, "inter_node_gbps": 200.0, "nics_per_node": 8}),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOP/s bf16 dense,
    # 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s (450 per direction); nvidia-smi shows
    # 81,559 MiB on an H100 80GB HBM3 (the lent machine, device/KINDS.md), 85.52 GB;
    # DGX H100 datasheet: eight 400 Gb/s NDR InfiniBand (ConnectX-7) NICs.
    # 132 SMs (NVIDIA H100 Tensor Core GPU Architecture whitepaper, SXM5).
    # GEMMs, attention and element-wise kernels as measured on one H100 80GB HBM3
    # (kernels/h100-sxm.json, experiments/kernel_bench.py); the analytic GEMM model,
    # for what the table does not price, with its constants fitted on those GEMMs.
    "h100-sxm": DeviceProfile(
        gpu={"tflops": 989.0, "memory_gb": 85.52, "hbm_tbps": 3.35, "sm_count": 132,
             "kernels": "h100-sxm", "architecture": "hopper", **HOPPER_GEMM_MODEL},
        links={"intra_node_gbps": 3600.0, "inter_node_gbps": 400.0, "nics_per_node": 8}),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): 989 TFLOP/s bf16 dense,
    # 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; DGX H200: eight 400 Gb/s NDR NICs;
    # nvidia-smi shows 143,771 MiB (the lent machine), 150.76 GB.
    # Kernels as measured on one H200 (kernels/h200-sxm.json, the same script):
    # GEMMs and attention within 2% of the H100's (the same SMs), element-wise
    # work up to 1.4x faster (its HBM). The H100's fit carries over (SHARED_FITS).
    "h200": DeviceProfile(
        gpu={"tflops": 989.0, "memory_gb": 150.76, "hbm_tbps": 4.8, "sm_count": 132,
             "kernels": "h200-sxm", "architecture": "hopper", **HOPPER_GEMM_MODEL},
        links={"intra_node_gbps": 3600.0, "inter_node_gbps": 400.0, "nics_per_node": 8}),
}


@dataclass(frozen=True)
class Fit:
    """Constants fitted for one device and software generation, and on which rows."""

    constants: dict[str, float]
    fitted_on: str


def load_fits(path: Path = FITS_FILE) -> dict[str, dict[str, Any]]:
    """Each device's fits by software generation (``default``: the generation whose
    constants serve one without rows of its own)."""
    fits = load_yaml(gate.read_text(path, "", gate.MAX_TEXT_BYTES), str(path))
    return fits if isinstance(fits, dict) else {}


# A device without published rows of its own that takes another's fit: the
# H200 has the H100's SMs and clocks, so what a step adds to its measured
# kernels (kernel_time_factor) and the element-wise traffic carry over.
SHARED_FITS = {"h200": "h100-sxm"}


def with_fits(specs: dict[str, DeviceProfile],
              fits: dict[str, dict[str, Any]]) -> dict[str, DeviceProfile]:
    """The profiles with their fits by generation (a device without a fit keeps none)."""
    def fits_of(name: str) -> tuple[dict[str, Fit], str]:
        device = fits.get(SHARED_FITS.get(name, name), {})
        by_software = {sw: Fit(dict(f.get("constants", {})), str(f.get("fitted_on", "")))
                       for sw, f in device.items() if isinstance(f, dict)}
        return by_software, str(device.get("default", ""))

    return {name: DeviceProfile(p.gpu, p.links, *fits_of(name)) for name, p in specs.items()}


DEVICES = with_fits(SPECS, load_fits())


def expand_device(cluster: dict[str, Any], profile: DeviceProfile) -> dict[str, Any]:
    """``cluster`` (a scenario's raw mapping) with the profile's values, and the
    constants fitted for its software generation (or the device's default
    generation's, where that one has no rows), under the keys it does not set itself."""
    gpu = dict(cluster["gpu"])
    fit = profile.fit_for(gpu.get("software") or DEFAULT_SOFTWARE)
    links = cluster.get("links") or {}
    return {**cluster,
            "gpu": {**profile.gpu, **(fit.constants if fit else {}), **gpu},
            "links": {**profile.links, **links}}


def fit_note(device: str | None, software: str | None) -> str | None:
    """Where a named device has no constants fitted for the scenario's software
    generation: whose constants stand in, and on what they were fitted."""
    if device is None or device not in DEVICES:
        return None
    profile, wanted = DEVICES[device], software or DEFAULT_SOFTWARE
    if wanted in profile.fits:
        return None
    fallback = profile.fits.get(profile.default_software)
    if fallback is None:
        return f"cluster.gpu.software: no constants are fitted on {device}; the model's defaults apply"
    return (f"cluster.gpu.software: {wanted} has no published rows fitted on {device}; the "
            f"constants of {profile.default_software} stand in (fitted on {fallback.fitted_on})")
