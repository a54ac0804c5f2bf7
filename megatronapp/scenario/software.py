"""Everything about the software that trains a scenario lives here: its generations.

``cluster.gpu: {device: h100-sxm, software: megatron-core-0.8}`` names the
framework release a run used. The generation decides two things: which
Megatron-core defaults a key left unset takes (``megatron_defaults.py``), and
which fitted efficiency constants the device profile supplies
(``device_fits.yaml``, fitted per device and generation on published rows of
that generation's own source). A scenario that names none runs the release
installed here, Megatron-core 0.16.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Software:
    """One framework release, as far as the simulator prices it."""

    name: str
    megatron_core: bool  # its layers are megatron-core's (async TP backward, TE specs)
    transformer_engine: bool  # attention_backend auto lets Transformer Engine pick a kernel
    describes: str  # what it is, and where a published run says it used it


SOFTWARE: dict[str, Software] = {s.name: s for s in (
    Software("megatron-lm-2021", False, False,
             "Megatron-LM as Narayanan et al. 2021 ran it (examples/sc21): no Transformer "
             "Engine, blocking TP backward"),
    Software("megatron-lm-2022", False, False,
             "Megatron-LM as Korthikanti et al. 2022 ran it: sequence parallelism and the "
             "asynchronous TP backward, no Transformer Engine"),
    Software("megatron-deepspeed", False, False,
             "Megatron-DeepSpeed with DeepSpeed's pipeline engine (MT-NLG 2022, BLOOM 2022)"),
    Software("llama3-2024", False, True,
             "Meta's own Llama 3 training stack (Dubey et al. 2024), priced with Megatron's "
             "schedules"),
    Software("megatron-core-0.8", True, True,
             "Megatron-Core r0.8.0 with Transformer Engine (the Megatron-LM README's H100 table)"),
    Software("megatron-core-0.16", True, True,
             "Megatron-Core 0.16 with Transformer Engine (the release installed here)"),
)}

DEFAULT_SOFTWARE = "megatron-core-0.16"  # what a scenario that names none runs
