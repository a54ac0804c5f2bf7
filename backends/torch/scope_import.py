"""``scope import``: read a checkpoint folder from the ecosystem (torch is
needed for ``pytorch_model.bin`` and Megatron's formats); the conversion is
``megatronapp.scope.imports``'.

- a Hugging Face folder written by ``save_pretrained``: ``config.json`` and
  ``model.safetensors`` (or its sharded index) or ``pytorch_model.bin``;
- a Megatron-LM / megatron-core checkpoint folder (the one holding
  ``latest_checkpointed_iteration.txt``, or an ``iter_*`` folder itself):
  ``torch_dist`` (PyTorch distributed checkpoint files, ``common.pt`` with the
  run's ``args``), whatever split wrote it, or the legacy format's
  ``mp_rank_00/model_optim_rng.pt`` (a run without tensor or pipeline
  parallelism).

Pickled files are read with torch's ``weights_only`` loader: tensors and
plain containers; any other object the file names (``argparse.Namespace``,
megatron's enums) is kept as inert data, never constructed or run.
"""
from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatronapp.errors import UserError
from megatronapp.io import gate
from megatronapp.scope.imports import Imported, import_gpt2, import_megatron

MAX_FOREIGN_TYPES = 64
TRACKER_BYTES = 1 << 10  # latest_checkpointed_iteration.txt holds one number
_NOT_ALLOWED = re.compile(r"GLOBAL (\S+) was not an allowed global")
MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")


class Inert:
    """An object of a type a pickled file names, kept as its data."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})


def load_pickled(path: Path) -> Any:
    """``torch.load(weights_only=True)``, with every other type stood in by ``Inert``."""
    names: list[str] = []
    checked = gate.checked(path, "SRC")
    for _ in range(MAX_FOREIGN_TYPES):
        try:
            with torch.serialization.safe_globals([(Inert, n) for n in names]):
                return torch.load(checked, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            match = _NOT_ALLOWED.search(str(err))
            if match is None or match.group(1) in names:
                raise UserError(f"SRC: {path} cannot be read safely ({str(err).splitlines()[0]})"
                                ) from None
            names.append(match.group(1))
        except (OSError, RuntimeError) as err:
            raise UserError(f"SRC: {path} is not a torch file ({err})") from None
    raise UserError(f"SRC: {path} names over {MAX_FOREIGN_TYPES} foreign types")


def _numpy(state: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in state.items()
            if isinstance(v, torch.Tensor)}


# ------------------------------------------------------------ Hugging Face
def _hf_weights(source: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    single, index = source / "model.safetensors", source / "model.safetensors.index.json"
    if single.is_file():
        return load_file(str(gate.checked(single, "SRC")))
    if index.is_file():
        shards = sorted(set(gate.read_json(index, "SRC")["weight_map"].values()))
        return {k: v for shard in shards
                for k, v in load_file(str(gate.checked(source / shard, "SRC"))).items()}
    binary = source / "pytorch_model.bin"
    if binary.is_file():
        return _numpy(load_pickled(binary))
    raise UserError(f"SRC: {source} has config.json but no model.safetensors or "
                    "pytorch_model.bin")


def read_hugging_face(source: Path) -> Imported:
    try:
        config = gate.read_json(source / "config.json", "SRC")
    except ValueError as err:  # the gate's one line names SRC and the file
        raise UserError(str(err)) from None
    return import_gpt2(config, lambda: _hf_weights(source), str(source))


# ---------------------------------------------------------------- Megatron
def _iteration_dir(source: Path) -> Path:
    tracker = source / "latest_checkpointed_iteration.txt"
    if not tracker.is_file():
        return source
    text = gate.read_text(tracker, "SRC", TRACKER_BYTES).strip()
    name = "release" if text == "release" else f"iter_{int(text):07d}"
    return source / name


def _args_of(common: Any, path: Path) -> dict[str, Any]:
    args = common.get("args") if isinstance(common, dict) else None
    if args is None:
        raise UserError(f"SRC: {path} holds no args (the run's configuration)")
    return dict(vars(args)) if not isinstance(args, dict) else args


def _unstacked(state: dict[str, np.ndarray], layers: int) -> dict[str, np.ndarray]:
    """torch_dist stacks a block's tensors over blocks (``decoder.layers.X``
    of shape ``[layers, ...]``): one tensor per block again."""
    out: dict[str, np.ndarray] = {}
    for name, value in state.items():
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"] and not parts[2].isdigit():
            rest = ".".join(parts[2:])
            out.update({f"decoder.layers.{i}.{rest}": value[i] for i in range(layers)})
        else:
            out[name] = value
    return out


def read_torch_dist(folder: Path) -> Imported:
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    args = _args_of(load_pickled(folder / "common.pt"), folder / "common.pt")
    reader = FileSystemReader(str(folder))
    metadata = reader.read_metadata().state_dict_metadata
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for k, m in metadata.items()
             if isinstance(m, TensorStorageMetadata) and k.startswith(MODEL_PREFIXES)}
    load(state, storage_reader=reader, no_dist=True)
    weights = _unstacked(_numpy(state), int(args["num_layers"]))
    return import_megatron(args, weights, str(folder), "torch_dist")


def read_legacy(folder: Path) -> Imported:
    shards = sorted(p.name for p in folder.glob("mp_rank_*"))
    if shards != ["mp_rank_00"]:
        raise UserError(f"SRC: {folder} holds {', '.join(shards) or 'no mp_rank_* folder'}: "
                        "a legacy checkpoint is read from one rank (mp_rank_00, a run without "
                        "tensor or pipeline parallelism); save it as torch_dist instead")
    path = folder / "mp_rank_00" / "model_optim_rng.pt"
    saved = load_pickled(path)
    model = saved.get("model") if isinstance(saved, dict) else None
    if not isinstance(model, dict):
        raise UserError(f"SRC: {path} holds no model state")
    return import_megatron(_args_of(saved, path), _numpy(model), str(folder), "legacy")


def read_foreign(source: Path) -> Imported:
    """A Hugging Face GPT-2 folder or a Megatron checkpoint folder, as ours."""
    source = Path(source)
    if not source.is_dir():
        raise UserError(f"SRC: {source} is not a directory")
    if (source / "config.json").is_file():
        return read_hugging_face(source)
    folder = _iteration_dir(source)
    if (folder / ".metadata").is_file() and (folder / "common.pt").is_file():
        return read_torch_dist(folder)
    if any(folder.glob("mp_rank_*")):
        return read_legacy(folder)
    raise UserError(f"SRC: {source} is neither a Hugging Face folder (config.json) nor a "
                    "Megatron checkpoint (latest_checkpointed_iteration.txt, iter_*/)")


def import_checkpoint(source: str | Path, out: str | Path, force: bool = False) -> Path:
    """``scope import`` in a notebook: ``out`` becomes a run directory that
    ``megatronapp.scope.load`` opens."""
    from megatronapp.io.outdirs import staged_dir
    from megatronapp.scope.imports import write_imported

    imported = read_foreign(Path(source))
    with staged_dir(Path(out), force) as tmp:
        write_imported(imported, tmp, Path(source))
    return Path(out)
