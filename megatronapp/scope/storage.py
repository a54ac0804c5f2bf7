"""Capture storage: per-rank parts written while running, one merged capture.

A capture directory holds (readable with pyarrow, safetensors and json alone,
no torch):

- ``manifest.json``: what was observed and perturbed, the model, the key
  columns, counters per rank (records, dropped records), the files;
- ``stats.parquet``: one row per (step, dp, microbatch, sample, layer, site,
  head, token, stat, index) with its ``value``. ``head`` is -1 for sites
  without heads, ``token`` and ``sample`` -1 for pooled rows, ``index`` 0 for
  a scalar statistic, else the channel (topk), bucket (hist) or block
  (pixels_*). Logits sit at layer ``layers + 1``;
- ``raw.json`` + ``raw/step{N}.safetensors``: raw slices kept by
  ``keep_raw``, each entry naming its tensor, file, key, dimension names,
  token positions and heads;
- ``injections.json``: the ground truth of every perturbation applied.

While a run goes on, each rank writes small self-contained part files under
``parts/rank{r}/`` (so a live reader can follow them); ``merge_capture``
combines the tensor-parallel slices of channel-split sites exactly (see
``stats``) and replaces the parts with the files above.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import UserError
from ..scope_spec import parse_stat

FORMAT = "megascope-capture"
VERSION = 1
INT_KEYS = ("step", "dp", "microbatch", "sample", "layer", "head", "token")
KEY = ("step", "dp", "microbatch", "sample", "layer", "site", "head", "token", "stat", "index")
STATS_SCHEMA = pa.schema([*((k, pa.int32()) for k in INT_KEYS[:5]), ("site", pa.string()),
                          *((k, pa.int32()) for k in INT_KEYS[5:]), ("stat", pa.string()),
                          ("index", pa.int64()), ("value", pa.float64())])
PARTIAL_SCHEMA = pa.schema([*((k, pa.int32()) for k in INT_KEYS[:5]), ("site", pa.string()),
                            *((k, pa.int32()) for k in INT_KEYS[5:]), ("stat", pa.string()),
                            ("shard", pa.int32()), ("nshards", pa.int32()),
                            ("part", pa.list_(pa.float64()))])


@dataclass(frozen=True)
class RecordKey:
    """Which tensor a record reduces: one site of one layer in one microbatch."""

    step: int
    dp: int
    microbatch: int
    layer: int
    site: str


@dataclass(frozen=True)
class Rows:
    """Row keys of a reduced record, one entry per row."""

    sample: np.ndarray
    head: np.ndarray
    token: np.ndarray

    def __len__(self) -> int:
        return len(self.sample)


@dataclass(frozen=True)
class HostRecord:
    """A reduced record on the host: partial columns per statistic, in order."""

    key: RecordKey
    rows: Rows
    stats: tuple[str, ...]  # labels
    widths: tuple[int, ...]  # partial columns of each
    partial: np.ndarray  # (rows, sum(widths)) float64
    shard: int = 0  # tensor-parallel slice of a channel-split site
    nshards: int = 1


def _key_columns(key: RecordKey, rows: Rows, repeat: int) -> dict[str, np.ndarray]:
    n = len(rows) * repeat
    const = {k: np.full(n, getattr(key, k), dtype=np.int32)
             for k in ("step", "dp", "microbatch", "layer")}
    return {**const, "sample": np.repeat(rows.sample, repeat).astype(np.int32),
            "site": np.full(n, key.site, dtype=object),
            "head": np.repeat(rows.head, repeat).astype(np.int32),
            "token": np.repeat(rows.token, repeat).astype(np.int32)}


def finished_rows(key: RecordKey, rows: Rows, label: str, index: np.ndarray,
                  values: np.ndarray) -> pa.Table:
    """Long rows of one statistic: ``index``/``values`` are (rows, W)."""
    width = values.shape[1]
    cols = _key_columns(key, rows, width)
    cols.update(stat=np.full(len(rows) * width, label, dtype=object),
                index=index.reshape(-1).astype(np.int64), value=values.reshape(-1))
    return pa.table({f.name: cols[f.name] for f in STATS_SCHEMA}, schema=STATS_SCHEMA)


def record_tables(rec: HostRecord) -> tuple[list[pa.Table], list[pa.Table]]:
    """(finished stats tables, partial tables still to merge over shards)."""
    from .stats import finish

    done: list[pa.Table] = []
    pending: list[pa.Table] = []
    start = 0
    for label, width in zip(rec.stats, rec.widths):
        part = rec.partial[:, start:start + width]
        start += width
        if rec.nshards == 1:
            index, values = finish(parse_stat(label), part)
            done.append(finished_rows(rec.key, rec.rows, label, index, values))
        else:
            cols = _key_columns(rec.key, rec.rows, 1)
            n = len(rec.rows)
            cols.update(stat=np.full(n, label, dtype=object), shard=np.full(n, rec.shard, np.int32),
                        nshards=np.full(n, rec.nshards, np.int32))
            arrays = [pa.array(cols[f.name], type=f.type) for f in PARTIAL_SCHEMA if f.name != "part"]
            arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(part.reshape(-1)), width)
                          .cast(pa.list_(pa.float64())))
            pending.append(pa.Table.from_arrays(arrays, schema=PARTIAL_SCHEMA))
    return done, pending


# ------------------------------------------------------------- part writer
@dataclass
class RawSlice:
    """A raw tensor kept by ``keep_raw`` (host numpy), with what it means."""

    key: RecordKey
    array: np.ndarray
    dims: tuple[str, ...]  # e.g. ("sample", "token", "channel")
    tokens: list[int]
    heads: list[int] | None
    split: str  # replicated | heads | channels
    shard: int = 0
    nshards: int = 1


@dataclass
class PartWriter:
    """One rank's part files (called from that rank's writer thread only)."""

    root: Path
    rank: int
    seq: int = 0
    counters: dict[str, int] = field(default_factory=lambda: {"records": 0, "rows": 0,
                                                              "raw_tensors": 0, "raw_bytes": 0})

    def __post_init__(self) -> None:
        self.dir = self.root / "parts" / f"rank{self.rank}"
        self.dir.mkdir(parents=True, exist_ok=True)

    def write(self, records: Sequence[HostRecord], raws: Sequence[RawSlice]) -> None:
        """One batch: a stats file, a partials file, a raw file (as needed)."""
        done: list[pa.Table] = []
        pending: list[pa.Table] = []
        for rec in records:
            d, p = record_tables(rec)
            done += d
            pending += p
        self.seq += 1
        if done:
            table = pa.concat_tables(done)
            self.counters["rows"] += table.num_rows
            _write_atomic(table, self.dir / f"stats-{self.seq:06d}.parquet")
        if pending:
            _write_atomic(pa.concat_tables(pending), self.dir / f"partials-{self.seq:06d}.parquet")
        if raws:
            self._write_raw(raws)
        self.counters["records"] += len(records)

    def _write_raw(self, raws: Sequence[RawSlice]) -> None:
        from safetensors.numpy import save_file

        tensors, entries = {}, []
        for i, r in enumerate(raws):
            name = f"t{i}"
            tensors[name] = np.ascontiguousarray(r.array)
            entries.append({"tensor": name, **r.key.__dict__, "dims": list(r.dims),
                            "tokens": r.tokens, "heads": r.heads, "split": r.split,
                            "shard": r.shard, "nshards": r.nshards})
            self.counters["raw_bytes"] += r.array.nbytes
        self.counters["raw_tensors"] += len(raws)
        base = self.dir / f"raw-{self.seq:06d}"
        save_file(tensors, str(base) + ".safetensors.tmp")
        Path(str(base) + ".safetensors.tmp").rename(str(base) + ".safetensors")
        (self.dir / f"raw-{self.seq:06d}.json").write_text(json.dumps(entries))

    def write_injections(self, injections: Iterable[dict[str, Any]]) -> None:
        with open(self.dir / "injections.jsonl", "a") as fh:
            for inj in injections:
                fh.write(json.dumps(inj) + "\n")

    def close(self, dropped: int, notes: Sequence[str] = (), **more: int) -> None:
        (self.dir / "counters.json").write_text(json.dumps({**self.counters, **more,
                                                            "dropped": dropped,
                                                            "notes": list(notes)}))


def _write_atomic(table: pa.Table, path: Path) -> None:
    """A reader following the parts never sees a half-written file."""
    tmp = path.with_suffix(".tmp")
    pq.write_table(table, tmp)
    tmp.rename(path)


# ------------------------------------------------------------------- merge
def _read_parts(root: Path, pattern: str, schema: pa.Schema) -> pa.Table:
    files = sorted((root / "parts").glob(f"rank*/{pattern}"))
    tables = [pq.read_table(f, schema=schema) for f in files]
    return pa.concat_tables(tables) if tables else schema.empty_table()


def merge_partials(table: pa.Table) -> tuple[pa.Table, int]:
    """Combine the TP slices of each partial row; (finished rows, incomplete
    rows dropped because a slice is missing)."""
    from .stats import combine, finish

    out, incomplete = [], 0
    for label in sorted(set(table.column("stat").to_pylist())):
        sub = table.filter(pc.equal(table.column("stat"), label))
        sites = sub.column("site").to_numpy(zero_copy_only=False)
        site_names, site_code = np.unique(sites, return_inverse=True)
        keys = np.stack([sub.column(k).to_numpy() for k in INT_KEYS] + [site_code], axis=1)
        shard = sub.column("shard").to_numpy()
        order = np.lexsort([shard, *keys.T[::-1]])
        keys, shard = keys[order], shard[order]
        nshards = sub.column("nshards").to_numpy()[order]
        parts = np.array(sub.column("part").to_pylist(), dtype=np.float64)[order]
        starts = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]).any(axis=1)])
        sizes = np.diff(np.r_[starts, len(keys)])
        complete = sizes == nshards[starts]
        incomplete += int(sizes[~complete].sum())
        spec = parse_stat(label)
        for n in sorted(set(sizes[complete])):
            group = starts[complete & (sizes == n)]
            stacked = np.stack([parts[group + s] for s in range(n)])  # (shards, groups, P)
            index, values = finish(spec, combine(spec, stacked))
            k = keys[group]
            cols = {name: k[:, i] for i, name in enumerate(INT_KEYS)}
            width = values.shape[1]
            table_cols = {name: np.repeat(v, width).astype(np.int32) for name, v in cols.items()}
            table_cols.update(site=np.repeat(site_names[k[:, -1]], width).astype(object),
                              stat=np.full(len(group) * width, label, dtype=object),
                              index=index.reshape(-1), value=values.reshape(-1))
            out.append(pa.table({f.name: table_cols[f.name] for f in STATS_SCHEMA},
                                schema=STATS_SCHEMA))
    return (pa.concat_tables(out) if out else STATS_SCHEMA.empty_table()), incomplete


def _merge_raw(root: Path, out: Path) -> list[dict[str, Any]]:
    """Raw slices of every rank -> one tensor per key (TP slices joined)."""
    from safetensors.numpy import load_file, save_file

    groups: dict[tuple[Any, ...], list[tuple[dict[str, Any], np.ndarray]]] = {}
    for meta_file in sorted((root / "parts").glob("rank*/raw-*.json")):
        tensors = load_file(str(meta_file.with_suffix(".safetensors")))
        for e in json.loads(meta_file.read_text()):
            key = (e["step"], e["dp"], e["microbatch"], e["layer"], e["site"])
            groups.setdefault(key, []).append((e, tensors[e["tensor"]]))
    index: list[dict[str, Any]] = []
    by_step: dict[int, dict[str, np.ndarray]] = {}
    for key in sorted(groups):
        pieces = sorted(groups[key], key=lambda p: p[0]["shard"])
        first = pieces[0][0]
        if len(pieces) != first["nshards"]:
            continue  # a slice was dropped: no partial tensor passes for a whole one
        arrays = [a for _, a in pieces]
        heads = first["heads"]
        if first["split"] == "channels":
            array = np.concatenate(arrays, axis=-1)
        elif first["split"] == "heads":
            array = np.concatenate(arrays, axis=first["dims"].index("head"))
            heads = [h for e, _ in pieces for h in e["heads"]]
        else:
            array = arrays[0]
        step, dp, mb, layer, site = key
        name = f"step{step}/dp{dp}/mb{mb}/layer{layer}/{site}"
        by_step.setdefault(step, {})[name] = array
        index.append({"name": name, "file": f"raw/step{step:06d}.safetensors", "step": step,
                      "dp": dp, "microbatch": mb, "layer": layer, "site": site,
                      "dims": first["dims"], "shape": list(array.shape),
                      "tokens": first["tokens"], "heads": heads})
    if by_step:
        (out / "raw").mkdir(exist_ok=True)
    for step, tensors in by_step.items():
        save_file(tensors, str(out / "raw" / f"step{step:06d}.safetensors"))
    return index


def _injections(root: Path) -> list[dict[str, Any]]:
    found = []
    for f in sorted((root / "parts").glob("rank*/injections.jsonl")):
        found += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return sorted(found, key=lambda i: (i.get("step", 0), i.get("rank", 0), i.get("order", 0)))


def _counters(root: Path) -> dict[str, dict[str, int]]:
    out = {}
    for f in sorted((root / "parts").glob("rank*/counters.json")):
        out[f.parent.name.removeprefix("rank")] = json.loads(f.read_text())
    return out


def merge_capture(root: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Replace ``root/parts`` by the merged files; returns the manifest written."""
    root = Path(root)
    stats = _read_parts(root, "stats-*.parquet", STATS_SCHEMA)
    merged, incomplete = merge_partials(_read_parts(root, "partials-*.parquet", PARTIAL_SCHEMA))
    table = pa.concat_tables([stats, merged]).sort_by([(k, "ascending") for k in KEY])
    pq.write_table(table, root / "stats.parquet")
    raw_index = _merge_raw(root, root)
    (root / "raw.json").write_text(json.dumps(raw_index))
    injections = _injections(root)
    (root / "injections.json").write_text(json.dumps(injections, indent=1))
    counters = _counters(root)
    full = {"format": FORMAT, "version": VERSION, **manifest, "key": list(KEY),
            "ranks": counters, "rows": table.num_rows, "raw_tensors": len(raw_index),
            "injections": len(injections), "incomplete_rows": incomplete,
            "dropped_records": sum(c.get("dropped", 0) for c in counters.values()),
            "notes": sorted({n for c in counters.values() for n in c.get("notes", [])}),
            "files": {"stats": "stats.parquet", "raw_index": "raw.json",
                      "injections": "injections.json"}}
    (root / "manifest.json").write_text(json.dumps(full, indent=2))
    shutil.rmtree(root / "parts", ignore_errors=True)
    return full


# ------------------------------------------------------------------ reader
class Capture:
    """A merged capture directory, read without torch."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        manifest = self.path / "manifest.json"
        if not manifest.is_file():
            raise UserError(f"CAPTURE_DIR: {self.path} is not a MegaScope capture "
                            f"(no manifest.json)")
        try:
            self.manifest: dict[str, Any] = json.loads(manifest.read_text())
        except (OSError, ValueError) as err:
            raise UserError(f"CAPTURE_DIR: {manifest} is unreadable: {err}") from None
        if self.manifest.get("format") != FORMAT:
            raise UserError(f"CAPTURE_DIR: {manifest} is not a {FORMAT} manifest")

    def stats(self) -> pa.Table:
        try:
            return pq.read_table(self.path / self.manifest["files"]["stats"])
        except (OSError, pa.ArrowInvalid) as err:
            raise UserError(f"CAPTURE_DIR: cannot read the statistics: {err}") from None

    def raw_index(self) -> list[dict[str, Any]]:
        return json.loads((self.path / self.manifest["files"]["raw_index"]).read_text())

    def raw(self, entry: dict[str, Any]) -> np.ndarray:
        from safetensors import safe_open

        with safe_open(str(self.path / entry["file"]), framework="np") as fh:
            return fh.get_tensor(entry["name"])

    def injections(self) -> list[dict[str, Any]]:
        return json.loads((self.path / self.manifest["files"]["injections"]).read_text())


def find_capture(path: str | Path) -> Path:
    """A capture directory, or a run directory holding one under ``scope/``."""
    p = Path(path)
    if (p / "manifest.json").is_file() or not (p / "scope" / "manifest.json").is_file():
        return p
    return p / "scope"
