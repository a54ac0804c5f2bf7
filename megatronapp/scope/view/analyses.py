"""The logit lens, activation patching and direct logit attribution results
stored with a capture, for the page.

``scope lens``, ``scope patch`` and ``scope dla`` write ``lens-HASH.json``,
``patch-HASH.json`` and ``dla-HASH.json`` beside the capture
(``megatronapp/scope/lens.py``). The
page asks for one by name; the name must be one of the files listed here,
and the file is validated against the fields the page draws (fields it does
not draw are dropped, so a result that gains fields still shows). JSON is
parsed, never evaluated; non-finite numbers go to the page as ``null``.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from ...errors import UserError
from ...io import gate
from .protocol import validation_reason

NAME = re.compile(r"(lens|patch|dla)-[0-9a-f]{12}")
MAX_RESULT_BYTES = 16 * 2**20  # a result file above this is not read (the page gets an error)


class _Result(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


def _sized(value: list[Any], of: list[Any] | None, what: str) -> list[Any]:
    """``value`` with one entry per entry of ``of`` (None: ``of`` failed its own check)."""
    if of is not None and len(value) != len(of):
        raise ValueError(f"one per {what} expected, got {len(value)} for {len(of)}")
    return value


class TopToken(_Result):
    token: str
    prob: float | None


class LensView(_Result):
    """``LensResult.to_json``: per row (where the stream is read) and position,
    the top tokens, and the rank of the next token."""

    analysis: Literal["lens"] = "lens"
    prompt: str
    tokens: list[str]
    rows: list[str]
    mean_rank: list[float | None]
    rank: list[list[int]]
    top: list[list[list[TopToken]]]

    @field_validator("mean_rank", "rank", "top")
    @classmethod
    def _one_per_row(cls, value: list[object], info: ValidationInfo) -> list[object]:
        # the page draws a row of cells per row: a count that disagrees has none to go to
        return _sized(value, info.data.get("rows"), "row")

    @field_validator("top")
    @classmethod
    def _a_choice_per_position(cls, value: list[list[list[TopToken]]], info: ValidationInfo
                               ) -> list[list[list[TopToken]]]:
        tokens = info.data.get("tokens")
        for row in value:
            _sized(row, tokens, "position")
            if any(not choices for choices in row):
                raise ValueError("a position without a top token")
        return value


class PatchView(_Result):
    """``PatchResult.to_json``: the restored metric per site, layer and position."""

    analysis: Literal["patch"] = "patch"
    clean: str
    corrupt: str
    tokens: list[str]
    answers: tuple[str, str]
    sites: list[str]
    layers: list[int]
    restored: list[list[list[float | None]]] = Field(description="(sites, layers, positions)")

    @field_validator("restored")
    @classmethod
    def _shaped(cls, value: list[list[list[float | None]]], info: ValidationInfo
                ) -> list[list[list[float | None]]]:
        # (sites, layers, positions): the page draws one map per site, a cell per layer and position
        for site in _sized(value, info.data.get("sites"), "site"):
            for layer in _sized(site, info.data.get("layers"), "layer"):
                _sized(layer, info.data.get("tokens"), "position")
        return value


class DlaView(_Result):
    """``DlaResult.to_json``: each head's direct share of ``logit[answer] -
    logit[baseline]`` at the last position, and the other parts of the stream."""

    analysis: Literal["dla"] = "dla"
    prompt: str
    tokens: list[str]
    answers: tuple[str, str]
    layers: list[int]
    heads: list[list[float | None]] = Field(description="(layers, heads)")
    embed: float | None
    attn_bias: list[float | None]
    mlp: list[float | None]
    norm_bias: float | None
    logit_diff: float | None

    @field_validator("heads", "attn_bias", "mlp")
    @classmethod
    def _one_per_layer(cls, value: list[object], info: ValidationInfo) -> list[object]:
        # the page draws these per layer: a count that disagrees has no bars to go to
        layers = info.data.get("layers")
        if layers is not None and len(value) != len(layers):
            raise ValueError(f"one per layer expected, got {len(value)} for {len(layers)} layers")
        return value

    @field_validator("heads")
    @classmethod
    def _as_many_heads_per_layer(cls, value: list[list[float | None]]) -> list[list[float | None]]:
        if len({len(row) for row in value}) > 1:
            raise ValueError("layers with different numbers of heads")
        return value


View = LensView | PatchView | DlaView
MODELS: dict[str, type[View]] = {"lens": LensView, "patch": PatchView, "dla": DlaView}


def listed(capture_dir: Path) -> dict[str, str]:
    """The results beside the capture: name -> a label for the page's menu."""
    out = {}
    for path in sorted(capture_dir.glob("*.json")):
        if NAME.fullmatch(path.stem):
            out[path.stem] = _label(path)
    return out


def _label(path: Path) -> str:
    try:
        view = read(path)
    except UserError as err:
        return f"{path.stem} (unreadable: {err})"
    if isinstance(view, LensView):
        return f"lens: {view.prompt!r}"
    if isinstance(view, DlaView):
        return f"dla: {view.prompt!r}, {view.answers[0]!r} over {view.answers[1]!r}"
    return f"patch: {view.clean!r} vs {view.corrupt!r}"


def read(path: Path) -> View:
    """The validated result in ``path``; ``UserError`` naming the file otherwise."""
    model = MODELS[path.stem.split("-")[0]]
    try:
        return model.model_validate_json(gate.read_input(path, "", MAX_RESULT_BYTES, ", not read"))
    except gate.InputError as err:  # a FIFO or a device is never opened: the server goes on
        raise UserError(f"{path.name}: {err.reason(path)}") from None
    except OSError as err:
        raise UserError(f"{path.name}: cannot be read ({err.strerror})") from None
    except ValidationError as err:
        raise UserError(f"{path.name}: {validation_reason(err, 'file')}") from None
