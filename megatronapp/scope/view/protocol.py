"""The view's wire protocol: client messages (validated, bounded) and binary frames.

A client sends JSON text messages of at most ``MAX_MESSAGE_BYTES``, each one
of the schemas below (extra fields refused), nested at most as deep as the
JSON parser's recursion limit. Types are strict: an integer field takes a JSON
integer only (not ``true``, ``"5"`` or ``5.0``), a number field a JSON number
(not a boolean or a string). Nothing received is evaluated: names are matched
against closed sets, numbers against bounds.

The server sends JSON text for small records and one binary frame per
array-carrying record: ``u32 little-endian header length``, the UTF-8 JSON
header (padded with spaces to a multiple of 4 bytes), then the arrays as
little-endian float32, one after another; the header lists each array's
``name``, ``shape`` and ``offset`` (in float32 elements from the data start).
"""
from __future__ import annotations

import json
import math
import struct
from typing import Annotated, Any, Literal, Mapping, Union

import numpy as np
from pydantic import (BaseModel, ConfigDict, Field, TypeAdapter, ValidationError,
                      field_validator)

from ...scenario.scope_spec import SITES

MAX_MESSAGE_BYTES = 4096  # a client message above this is refused (the connection stays)
MAX_FRAME_BYTES = 65536  # the websocket layer closes a connection sending a bigger frame
MAX_PROMPT_CHARS = 256
MAX_TOKENS = 256
MAX_TOP_K = 20
PERTURBABLE_SITES = tuple(s for s, info in SITES.items() if info.perturbable)


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Perturbation(_Message):
    """One activation perturbation a client may ask for (server started with
    ``--allow-perturb``); bounded, and validated again as a ``scope:`` entry."""

    kind: Literal["act_noise", "act_offset", "head_mask"]
    site: str = "resid_post"
    layer: int = Field(default=1, ge=1, le=1024)
    sigma: float = Field(default=0.1, ge=0.0, le=5.0)
    value: float = Field(default=0.0, ge=-10.0, le=10.0)
    heads: tuple[Annotated[int, Field(ge=0, le=1023)], ...] = Field(default=(0,), max_length=64)

    @field_validator("site")
    @classmethod
    def _known_site(cls, site: str) -> str:
        if site not in PERTURBABLE_SITES:
            raise ValueError(f"site must be one of {', '.join(PERTURBABLE_SITES)}")
        return site

    @field_validator("sigma", "value")
    @classmethod
    def _finite(cls, x: float) -> float:
        if not math.isfinite(x):
            raise ValueError("must be finite")
        return x

    def scope_entry(self) -> dict[str, Any]:
        """The ``scope.perturb`` entry this asks for."""
        common: dict[str, Any] = {"kind": self.kind, "layers": [self.layer]}
        if self.kind == "head_mask":
            return {**common, "heads": list(self.heads)}
        if self.kind == "act_noise":
            return {**common, "site": self.site, "sigma": self.sigma, "relative": True}
        return {**common, "site": self.site, "value": self.value}


class Generate(_Message):
    type: Literal["generate"]
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    tokens: int = Field(default=32, ge=1, le=MAX_TOKENS)
    top_k: int = Field(default=5, ge=1, le=MAX_TOP_K)
    perturb: Perturbation | None = None


class Stop(_Message):
    type: Literal["stop"]


class Series(_Message):
    """A training statistic over steps: names looked up in the capture's table."""

    type: Literal["series"]
    site: str = Field(max_length=64)
    stat: str = Field(max_length=64)


class Analysis(_Message):
    """A logit lens, patching or attribution result stored with the capture, by its file's name."""

    type: Literal["analysis"]
    name: str = Field(max_length=64)


ClientMessage = Annotated[Union[Generate, Stop, Series, Analysis], Field(discriminator="type")]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(ClientMessage)


class Refused(Exception):
    """A client message that is not accepted; the reason is one line."""


def validation_reason(err: ValidationError, whole: str = "message") -> str:
    """The first problem pydantic found, as ``field: message`` (``whole`` when
    it is not a field's)."""
    first = err.errors(include_url=False)[0]
    where = ".".join(str(p) for p in first["loc"]) or whole
    return f"{where}: {first['msg']}"


def parse_message(text: str) -> Generate | Stop | Series | Analysis:
    """Size check first, then JSON and the schema in one strict pass (pydantic's
    parser bounds the nesting depth); ``Refused`` otherwise."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_MESSAGE_BYTES:
        raise Refused(f"message over {MAX_MESSAGE_BYTES} bytes")
    try:
        return _ADAPTER.validate_json(text)  # type: ignore[no-any-return]
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            raise Refused(f"message is not JSON ({first['msg'].removeprefix('Invalid JSON: ')})"
                          ) from None
        raise Refused(validation_reason(err)) from None


def encode_frame(header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> bytes:
    """One binary frame: the header (with each array's name, shape, offset) and float32 data."""
    specs, chunks, offset = [], [], 0
    for name, a in arrays.items():
        data = np.ascontiguousarray(a, dtype="<f4")
        specs.append({"name": name, "shape": list(data.shape), "offset": offset})
        chunks.append(data.tobytes())
        offset += data.size
    head = json.dumps({**header, "arrays": specs}).encode("utf-8")
    head += b" " * (-len(head) % 4)
    return struct.pack("<I", len(head)) + head + b"".join(chunks)


def decode_frame(frame: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The inverse of ``encode_frame`` (used by tests and the benchmark)."""
    (n,) = struct.unpack_from("<I", frame)
    header = json.loads(frame[4:4 + n])
    data = np.frombuffer(frame, dtype="<f4", offset=4 + n)
    arrays = {s["name"]: data[s["offset"]:s["offset"] + int(np.prod(s["shape"]))]
              .reshape(s["shape"]) for s in header["arrays"]}
    return header, arrays
