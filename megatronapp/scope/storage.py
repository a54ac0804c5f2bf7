"""Capture storage: per-rank parts written while running, one merged capture.

A capture directory holds (readable with pyarrow, safetensors and json alone,
no torch):

- ``manifest.json``: what was observed and perturbed, the model, the key
  columns, counters per rank (records, dropped records), the files;
- ``stats.parquet``: one row per (step, dp, microbatch, sample, layer, site,
  head, token, stat). A scalar statistic fills ``value``; an indexed one
  (topk, hist, pixels_*) fills the lists ``index`` (channel, bucket or block)
  and ``values`` instead. ``head`` is -1 for sites without heads, ``token``
  and ``sample`` -1 for pooled rows, ``microbatch`` -1 for parameter
  gradients (taken at the optimizer step). Logits sit at layer ``layers + 1``;
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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import UserError
from ..io import gate
from ..io.outdirs import MANIFEST_KIND, discard, own_folder, rename_fresh
from ..io.text import TextError
from ..scenario.scope_spec import parse_stat

FORMAT = "megascope-capture"
VERSION = 1
INT_KEYS = ("step", "dp", "microbatch", "sample", "layer", "head", "token")
KEY = ("step", "dp", "microbatch", "sample", "layer", "site", "head", "token", "stat")
_KEY_FIELDS = [*((k, pa.int32()) for k in INT_KEYS[:5]), ("site", pa.string()),
               *((k, pa.int32()) for k in INT_KEYS[5:]), ("stat", pa.string())]
STATS_SCHEMA = pa.schema([*_KEY_FIELDS, ("value", pa.float64()), ("index", pa.list_(pa.int64())),
                          ("values", pa.list_(pa.float64()))])
PARTIAL_SCHEMA = pa.schema([*_KEY_FIELDS, ("shard", pa.int32()), ("nshards", pa.int32()),
                            ("part", pa.list_(pa.float64()))])
FLUSH_ROWS = 200_000  # a rank's part file holds about this many rows ...
FLUSH_S = 2.0  # ... or what came in this long (a live reader sees it soon)


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


@dataclass(frozen=True)
class KeyColumns:
    """Key columns of many rows (records stacked)."""

    ints: dict[str, np.ndarray]  # INT_KEYS -> int32 per row
    site_codes: np.ndarray
    sites: list[str]

    @classmethod
    def of(cls, records: Sequence[HostRecord]) -> "KeyColumns":
        lens = [len(r.rows) for r in records]
        ints = {k: np.repeat(np.array([getattr(r.key, k) for r in records], np.int32), lens)
                for k in ("step", "dp", "microbatch", "layer")}
        for k in ("sample", "head", "token"):
            ints[k] = np.concatenate([getattr(r.rows, k) for r in records]).astype(np.int32)
        sites = sorted({r.key.site for r in records})
        codes = np.repeat(np.array([sites.index(r.key.site) for r in records], np.int32), lens)
        return cls(ints, codes, sites)

    def arrays(self, label: str) -> list[pa.Array]:
        n = len(self.site_codes)
        site = pa.DictionaryArray.from_arrays(pa.array(self.site_codes), pa.array(self.sites))
        cols = {k: pa.array(v) for k, v in self.ints.items()}
        return [cols["step"], cols["dp"], cols["microbatch"], cols["sample"], cols["layer"],
                site.cast(pa.string()), cols["head"], cols["token"],
                pa.repeat(pa.scalar(label), n)]


def _lists(values: np.ndarray, kind: pa.DataType) -> pa.Array:
    """(rows, W) -> a list column of W values per row."""
    flat = pa.array(np.ascontiguousarray(values).reshape(-1))
    return pa.FixedSizeListArray.from_arrays(flat, values.shape[1]).cast(pa.list_(kind))


def stat_rows(keys: KeyColumns, label: str, index: np.ndarray, values: np.ndarray) -> pa.Table:
    """One statistic of stacked records: ``index``/``values`` are (rows, W)."""
    n = len(keys.site_codes)
    if parse_stat(label).info.indexed:
        data = [pa.nulls(n, pa.float64()), _lists(index.astype(np.int64), pa.int64()),
                _lists(values.astype(np.float64), pa.float64())]
    else:
        data = [pa.array(values[:, 0].astype(np.float64)), pa.nulls(n, pa.list_(pa.int64())),
                pa.nulls(n, pa.list_(pa.float64()))]
    return pa.Table.from_arrays(keys.arrays(label) + data, schema=STATS_SCHEMA)


def record_tables(records: Sequence[HostRecord]) -> tuple[list[pa.Table], list[pa.Table]]:
    """(finished stats tables, partial tables still to merge over shards), one
    table per statistic for all records that share their statistics."""
    from .stats import finish

    groups: dict[tuple[Any, ...], list[HostRecord]] = {}
    for rec in records:
        groups.setdefault((rec.stats, rec.widths, rec.nshards > 1), []).append(rec)
    done: list[pa.Table] = []
    pending: list[pa.Table] = []
    for (labels, widths, split), recs in groups.items():
        keys = KeyColumns.of(recs)
        partial = np.concatenate([r.partial for r in recs])
        if split:
            lens = [len(r.rows) for r in recs]
            shard = [pa.array(np.repeat(np.array([r.shard for r in recs], np.int32), lens)),
                     pa.array(np.repeat(np.array([r.nshards for r in recs], np.int32), lens))]
        start = 0
        for label, width in zip(labels, widths):
            part = partial[:, start:start + width]
            start += width
            if split:
                pending.append(pa.Table.from_arrays(
                    keys.arrays(label) + shard + [_lists(part, pa.float64())],
                    schema=PARTIAL_SCHEMA))
            else:
                done.append(stat_rows(keys, label, *finish(parse_stat(label), part)))
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
    """One rank's part files (called from that rank's writer thread only).
    Statistics are buffered and written as a file every ``FLUSH_ROWS`` rows or
    ``FLUSH_S`` seconds, and at ``close``."""

    root: Path
    rank: int
    seq: int = 0
    counters: dict[str, int] = field(default_factory=lambda: {"records": 0, "rows": 0,
                                                              "raw_tensors": 0, "raw_bytes": 0})
    _done: list[pa.Table] = field(default_factory=list)
    _pending: list[pa.Table] = field(default_factory=list)
    _rows: int = 0
    _since: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.dir = own_folder(self.root / "parts") / f"rank{self.rank}"
        self.dir.mkdir(exist_ok=True)

    def write(self, records: Sequence[HostRecord], raws: Sequence[RawSlice]) -> None:
        done, pending = record_tables(records)
        self._done += done
        self._pending += pending
        self._rows += sum(t.num_rows for t in done + pending)
        self.counters["records"] += len(records)
        if raws:
            self.seq += 1
            self._write_raw(raws)
        if self._rows >= FLUSH_ROWS or time.monotonic() - self._since >= FLUSH_S:
            self.flush()

    def flush(self) -> None:
        self.seq += 1
        if self._done:
            table = pa.concat_tables(self._done)
            self.counters["rows"] += table.num_rows
            _write_atomic(table, self.dir / f"stats-{self.seq:06d}.parquet")
        if self._pending:
            _write_atomic(pa.concat_tables(self._pending),
                          self.dir / f"partials-{self.seq:06d}.parquet")
        self._done, self._pending, self._rows = [], [], 0
        self._since = time.monotonic()

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
        rename_fresh(Path(str(base) + ".safetensors.tmp"), Path(str(base) + ".safetensors"))
        (self.dir / f"raw-{self.seq:06d}.json").write_text(json.dumps(entries))

    def write_injections(self, injections: Iterable[dict[str, Any]]) -> None:
        with open(self.dir / "injections.jsonl", "a") as fh:
            for inj in injections:
                fh.write(json.dumps(inj) + "\n")

    def close(self, dropped: int, notes: Sequence[str] = (), **more: int) -> None:
        self.flush()
        (self.dir / "counters.json").write_text(json.dumps({**self.counters, **more,
                                                            "dropped": dropped,
                                                            "notes": list(notes)}))


def _write_atomic(table: pa.Table, path: Path) -> None:
    """A reader following the parts never sees a half-written file."""
    tmp = path.with_suffix(".tmp")
    pq.write_table(table, tmp)
    rename_fresh(tmp, path)


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
        flat = pc.list_flatten(sub.column("part")).to_numpy()
        parts = flat.reshape(sub.num_rows, -1)[order]
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
            cols = KeyColumns({name: k[:, i].astype(np.int32) for i, name in enumerate(INT_KEYS)},
                              k[:, -1].astype(np.int32), [str(x) for x in site_names])
            out.append(stat_rows(cols, label, index, values))
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


def _counters(root: Path) -> dict[str, dict[str, Any]]:
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
    discard(root / "parts")  # marked by PartWriter as ours
    return full


# ------------------------------------------------------------------ reader
class Capture:
    """A merged capture directory, read without torch."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        manifest = self.path / "manifest.json"
        if not gate.exists(manifest, "CAPTURE_DIR"):
            raise UserError(f"CAPTURE_DIR: {self.path} is not a MegaScope capture "
                            f"(no manifest.json)")
        data = _capture_json(manifest)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise UserError(f"CAPTURE_DIR: {manifest} is not a {FORMAT} manifest")
        files = data.get("files")
        if not isinstance(files, dict) or not all(
                isinstance(files.get(k), str) for k in ("stats", "raw_index", "injections")):
            raise UserError(f"CAPTURE_DIR: {manifest}: 'files' must name stats, raw_index and "
                            "injections")
        self.manifest: dict[str, Any] = data

    def _file(self, key: str) -> Path:
        """A file the manifest names, inside the capture (a name, not a path elsewhere)."""
        name = self.manifest["files"][key]
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise UserError(f"CAPTURE_DIR: {self.path / 'manifest.json'}: files.{key} must be "
                            f"a file inside the capture, got {name!r:.80}")
        return self.path / name

    def stats(self) -> pa.Table:
        try:
            return pq.read_table(gate.checked(self._file("stats"), "CAPTURE_DIR"))
        except (OSError, pa.ArrowException) as err:
            raise UserError(f"CAPTURE_DIR: cannot read the statistics: "
                            f"{str(err).splitlines()[0]}") from None

    def raw_index(self) -> list[dict[str, Any]]:
        return _json_list(self._file("raw_index"))

    def raw(self, entry: dict[str, Any]) -> np.ndarray:
        from safetensors import safe_open

        with safe_open(str(gate.checked(self.path / entry["file"], "CAPTURE_DIR")),
                       framework="np") as fh:
            return fh.get_tensor(entry["name"])

    def injections(self) -> list[dict[str, Any]]:
        return _json_list(self._file("injections"))


def _capture_json(path: Path) -> Any:
    """A capture's JSON file through the input gate; anything unreadable is one line."""
    try:
        return gate.read_json(path, "CAPTURE_DIR")
    except TextError as err:
        raise UserError(str(err) if isinstance(err, UserError) else f"CAPTURE_DIR: {err}") \
            from None


def _json_list(path: Path) -> list[Any]:
    data = _capture_json(path)
    if not isinstance(data, list) or not all(isinstance(e, dict) for e in data):
        raise UserError(f"CAPTURE_DIR: {path} must hold a list of objects")
    return data


def _manifest_field(folder: Path, key: str) -> Any:
    """``key`` of ``folder/manifest.json``; None when there is no readable one."""
    manifest = folder / "manifest.json"
    if not gate.exists(manifest, "CAPTURE_DIR"):  # a FIFO or a device there is refused
        return None
    try:
        data = gate.read_json(manifest, "CAPTURE_DIR")
    except gate.InputError:
        raise
    except TextError:
        return None
    return data.get(key) if isinstance(data, dict) else None


def find_capture(path: str | Path, field: str = "CAPTURE_DIR") -> Path:
    """The capture under ``path``: a capture directory itself, a run directory's
    ``scope/`` or a ``scope generate`` output's ``clean/``. A run directory has a
    manifest of its own (a result manifest), so the format decides, not the name.
    ``UserError`` (naming ``field``, the command's argument) saying what to do
    when there is none."""
    root = Path(path)
    if not gate.exists(root, field, "any") or not root.is_dir():
        raise UserError(f"{field}: {root} is not a directory")
    found = next((c for c in (root, root / "scope", root / "clean")
                  if _manifest_field(c, "format") == FORMAT), None)
    if found is not None:
        return found
    if _manifest_field(root, "kind") == MANIFEST_KIND:
        raise UserError(f"{field}: {root} is a run without a MegaScope capture: add a "
                        "scope: section to its scenario (see scenarios/scope_tiny.yaml) and "
                        "run it again, or use scope generate on its checkpoint")
    raise UserError(f"{field}: {root} is not a MegaScope capture (no {FORMAT} manifest "
                    "there, in scope/ or in clean/)")


def checkpoint_dir(target: str | Path) -> Path:
    """A checkpoint directory, a run directory holding one, or a generation
    capture (or its ``scope generate`` output) naming the checkpoint it ran on."""
    p = Path(target)
    if (p / "checkpoint" / "checkpoint.json").is_file():
        return p / "checkpoint"
    for capture in (p, p / "clean"):
        try:
            named = gate.read_json(capture / "manifest.json", "").get("checkpoint")
        except (OSError, ValueError, AttributeError):  # a TextError (a FIFO, bad JSON) too
            continue
        if isinstance(named, str):
            return Path(named)
    return p
