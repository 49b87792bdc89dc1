"""Measured launch tables of kimi's kernels: one schema, one loader.

Each table is a JSON file beside this module, written by the tool its `tuner` field names (re-running that command
regenerates it), and used only on the GPU it was measured on (`gpu`, as torch.cuda.get_device_name gives it).

Schema (every table; `TuningTable`, type-checked on load):
    {"gpu": str, "date": str (ISO 8601), "tuner": str (the command that regenerates the file), "notes": str (optional),
     "entries": [entry, ...]}
    entry: {"n": int, "k": int (the GEMM's N, K), the rows it applies to -- "m": int (an M bucket: tables of
     `TableSpec.keys` "bucket") or "m_min": int, "m_max": int or null (no bound; tables of keys "range") --,
     "config": {launch fields of the kernel}, and optionally "weight": "int4" | "fp8", "e_local": int (the layers
     it was measured on), "over_heuristic": bool (config holds only the fields it replaces in a heuristic
     schedule); other fields (labels, measurements) are kept in the file for the reader and ignored here}.
    Tables of keys "launch" (launch parameters not keyed by a GEMM shape) hold instead
    entry: {"name": str (the kernel launch it configures, unique in the table), "config": {field: int or null},
     optionally "m_min": int (the rows it applies from)}; they load into `TuningTable.launch` (`entries` empty) and
     apply on every GPU (their `gpu` records where they were measured).

`load(name)` reads the shipped table (or the file its environment variable names), `dump` writes one; the kernels
turn `TuningTable.entries` into their own config types, and a launch table's entries by `launch_configs`.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kimi import envs

__all__ = [
    "DIR",
    "TABLES",
    "LaunchEntry",
    "TableEntry",
    "TableSpec",
    "TuningTable",
    "bucket_entries",
    "by_bucket",
    "dump",
    "launch_configs",
    "launch_entries",
    "load",
    "path_of",
]

DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class TableEntry:
    """One measured pick: the launch `config` of GEMM [n, k] for the rows `m` (bucket) or `m_min`..`m_max`."""

    n: int
    k: int
    config: dict[str, Any]
    m: int | None = None
    m_min: int | None = None
    m_max: int | None = None
    weight: Literal["int4", "fp8"] = "int4"
    e_local: int | None = None
    over_heuristic: bool = False


@dataclass(frozen=True)
class LaunchEntry:
    """One named launch config of a "launch" table: kernel launch `name`, its `config`, from `m_min` rows on (None:
    any)."""

    name: str
    config: dict[str, int | None]
    m_min: int | None = None


@dataclass(frozen=True)
class TuningTable:
    """A table file: where it was measured, how to regenerate it, its entries (in file order): GEMM entries in
    `entries`, named launch configs (tables of keys "launch") in `launch`."""

    gpu: str | None
    date: str
    tuner: str
    entries: tuple[TableEntry, ...]
    notes: str = ""
    launch: tuple[LaunchEntry, ...] = ()


@dataclass(frozen=True)
class TableSpec:
    """A shipped table: its file in this folder, the environment variable that names another file instead (None:
    none; read at load; "" or "off" gives an empty table), and how its entries name their rows ("bucket": `m`; "range":
    `m_min` / `m_max`; "launch": named launch configs, not keyed by a GEMM)."""

    file: str
    env: str | None
    keys: Literal["bucket", "range", "launch"]


TABLES: dict[str, TableSpec] = {
    "linear_small_m": TableSpec("linear_small_m.json", "KIMI_LINEAR_SMALL_M_TABLE", "bucket"),
    "bmm_small_m": TableSpec("bmm_small_m.json", "KIMI_BMM_SMALL_M_TABLE", "bucket"),
    "linear_fp8": TableSpec("linear_fp8.json", "KIMI_LINEAR_FP8_TABLE", "bucket"),
    "humming": TableSpec("humming.json", "KIMI_HUMMING_TABLE", "range"),
    "moe_w4a16_cuda": TableSpec("moe_w4a16_cuda.json", None, "range"),
    "small_kernels": TableSpec("small_kernels.json", None, "launch"),
    "mla_decode": TableSpec("mla_decode.json", None, "launch"),
}

EMPTY = TuningTable(gpu=None, date="", tuner="", entries=())


def path_of(name: str) -> Path | None:
    """The file table `name` is read from: $<spec.env> when set (None when it is "" or "off"), else the shipped
    file. Raises KeyError for an unknown name."""
    spec = TABLES[name]
    env = envs.by_name(spec.env).get() if spec.env else None
    if env is not None:
        return None if env.strip().lower() in ("", "off") else Path(env)
    return DIR / spec.file


_ENTRY_TYPES: dict[str, tuple[type, ...]] = {
    "n": (int,),
    "k": (int,),
    "config": (dict,),
    "m": (int, type(None)),
    "m_min": (int, type(None)),
    "m_max": (int, type(None)),
    "e_local": (int, type(None)),
    "over_heuristic": (bool,),
    "weight": (str,),
}


def _field(raw: dict[str, Any], key: str, types: tuple[type, ...], where: str) -> Any:
    v = raw[key]
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
        raise ValueError(f"{where}{key} {v!r}: want {' or '.join(t.__name__ for t in types)}")
    return v


def _launch_entry(e: dict[str, Any], i: int) -> LaunchEntry:
    where = f"entry {i}: "
    name = _field(e, "name", (str,), where)
    config = _field(e, "config", (dict,), where)
    for key, v in config.items():
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise ValueError(f"{where}config {key} {v!r}: want int or null")
    m_min = _field(e, "m_min", (int, type(None)), where) if "m_min" in e else None
    return LaunchEntry(name=name, config=config, m_min=m_min)


def _parse(raw: Any) -> TuningTable:
    """TuningTable of a decoded file; ValueError naming the first field off the schema. An entry with "name" and no
    "n" is a launch entry (`LaunchEntry`), any other a GEMM entry."""
    if not isinstance(raw, dict):
        raise ValueError("the file is not a JSON object")
    try:
        head = {key: _field(raw, key, (str,), "") for key in ("gpu", "date", "tuner")}
        entries_raw = _field(raw, "entries", (list,), "")
        entries = []
        launch = []
        for i, e in enumerate(entries_raw):
            if not isinstance(e, dict):
                raise ValueError(f"entry {i} is not an object")
            if "name" in e and "n" not in e:
                launch.append(_launch_entry(e, i))
                continue
            missing = [key for key in ("n", "k", "config") if key not in e]
            if missing:
                raise ValueError(f"entry {i}: no {', '.join(missing)}")
            fields = {key: _field(e, key, types, f"entry {i}: ") for key, types in _ENTRY_TYPES.items() if key in e}
            if fields.get("weight", "int4") not in ("int4", "fp8"):
                raise ValueError(f"entry {i}: weight {fields['weight']!r} (want int4 or fp8)")
            entries.append(TableEntry(**fields))
    except KeyError as e:
        raise ValueError(f"missing field {e}") from None
    notes = _field(raw, "notes", (str,), "") if "notes" in raw else ""
    return TuningTable(entries=tuple(entries), notes=notes, launch=tuple(launch), **head)


def _check(t: TuningTable, keys: str) -> None:
    if keys == "launch":
        if t.entries:
            raise ValueError("a launch table holds named launch configs only (an entry has 'n')")
        names = [e.name for e in t.launch]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"names {dup} appear more than once")
        low = [e.name for e in t.launch if e.m_min is not None and e.m_min < 1]
        if low:
            raise ValueError(f"{low}: want m_min >= 1")
        return
    if t.launch:
        raise ValueError(f"entry {t.launch[0].name!r}: a GEMM table's entries name their 'n', 'k'")
    for i, e in enumerate(t.entries):
        if keys == "bucket":
            if e.m is None or e.m < 1 or e.m_min is not None or e.m_max is not None:
                raise ValueError(f"entry {i}: want an M bucket 'm' >= 1 (and no m_min / m_max)")
        else:
            if e.m is not None or e.m_min is None or e.m_min < 1 or (e.m_max is not None and e.m_max < e.m_min):
                raise ValueError(f"entry {i}: want 1 <= m_min <= m_max (m_max null: no bound), no 'm'")
        if e.n < 1 or e.k < 1:
            raise ValueError(f"entry {i}: n {e.n}, k {e.k}")


def load(name: str, path: str | os.PathLike[str] | None = None) -> TuningTable:
    """Table `name` (a key of TABLES) from `path`, else from `path_of(name)`. A missing file (or a disabled one)
    gives an empty table (gpu None). Raises ValueError on a file that does not follow the schema, KeyError on an
    unknown name."""
    spec = TABLES[name]
    p = Path(path) if path is not None else path_of(name)
    if p is None or not p.exists():
        return EMPTY
    try:
        table = _parse(json.loads(p.read_text()))
        _check(table, spec.keys)
    except ValueError as e:  # json.JSONDecodeError included
        raise ValueError(f"bad {name} table {p}: {e}") from e
    return table


def dump(path: str | os.PathLike[str], gpu: str, tuner: str, entries: list[dict[str, Any]], notes: str = "") -> None:
    """Write a table file in the schema above, dated now. `entries`: dicts of TableEntry's fields (extra fields are
    kept in the file). Raises ValueError when an entry does not follow the schema."""
    raw: dict[str, Any] = {"gpu": gpu, "date": datetime.datetime.now().isoformat(timespec="seconds"), "tuner": tuner}
    if notes:
        raw["notes"] = notes
    raw["entries"] = entries
    _parse(raw)  # validates before anything is written
    Path(path).write_text(json.dumps(raw, indent=1) + "\n")


def by_bucket(table: TuningTable, config_type: type) -> dict[str, Any]:
    """{"gpu": table.gpu, "entries": {(m, n, k): config_type(**entry.config)}} of a bucket-keyed table (what the
    small-M GEMM launchers look up). Raises ValueError when an entry's config does not fit config_type."""
    entries = {}
    for e in table.entries:
        try:
            entries[(e.m, e.n, e.k)] = config_type(**e.config)
        except TypeError as err:
            raise ValueError(f"bad {config_type.__name__} entry ({e.m}, {e.n}, {e.k}): {err}") from err
    return {"gpu": table.gpu, "entries": entries}


def bucket_entries(picks: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Entries of a bucket-keyed table from a tuner's picks {"<M bucket>,<N>,<K>": config} (for `dump`)."""
    out = []
    for key, cfg in picks.items():
        m, n, k = (int(v) for v in key.split(","))
        out.append({"m": m, "n": n, "k": k, "config": cfg})
    return out


def launch_configs(table: TuningTable, fields: dict[str, tuple[str, ...]]) -> dict[str, dict[str, int | None]]:
    """{name: config} of a launch table for every name of `fields` (other names are other kernels' and skipped), an
    entry's m_min as its config's "m_min". Each config must hold exactly the fields fields[name] ("m_min" among them
    where the entry has one). Raises ValueError naming the first name missing from the table or off its fields."""
    by_name = {e.name: e for e in table.launch}
    out = {}
    for name, want in fields.items():
        e = by_name.get(name)
        if e is None:
            raise ValueError(f"launch table ({table.tuner!r}) has no entry {name!r}")
        cfg = dict(e.config) | ({"m_min": e.m_min} if e.m_min is not None else {})
        if sorted(cfg) != sorted(want):
            raise ValueError(f"launch entry {name!r}: fields {sorted(cfg)}, want {sorted(want)}")
        out[name] = cfg
    return out


def launch_entries(configs: dict[str, dict[str, int | None]]) -> list[dict[str, Any]]:
    """Entries of a launch table (for `dump`) from {name: config} (a config's "m_min" goes to its entry): the inverse
    of `launch_configs`."""
    out = []
    for name, cfg in configs.items():
        entry: dict[str, Any] = {"name": name, "config": {k: v for k, v in cfg.items() if k != "m_min"}}
        if cfg.get("m_min") is not None:
            entry["m_min"] = cfg["m_min"]
        out.append(entry)
    return out
