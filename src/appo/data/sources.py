"""Data source specs and raw row readers (parquet, JSONL, JSON, Hugging Face dataset dirs).

A data source is named by a *spec* string, as in `data.train_files` / `sft.train_files`:

    spec     := synth | file
    synth    := "synth:" TASK [ "?" options ]        e.g. synth:arith?split=eval&levels=2,3
    file     := PATH [ "?" options ]                  e.g. data/gsm8k/test.jsonl?n=200
    options  := KEY "=" VALUE { "&" KEY "=" VALUE }

File options: `n` (keep the first n rows), `data_source`, `ability` (set for every row,
overriding the file's own), `split` (which split of a Hugging Face `DatasetDict` directory or
of a directory of split files; default `train`). Synthetic options are listed in
`appo.data.synth`. A path that exists as given is never split at "?".

Rows already in memory (a list of dicts, a pyarrow Table, a `datasets.Dataset`) come in as
`InMemoryRows` (`rows_from_object`) and are read like a file's rows.

Readers return plain row dicts (pyarrow `to_pylist` / `json.loads`); turning rows into typed
examples, with checks, is `appo.data.rl` / `appo.data.sft`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appo.errors import AppoError
from appo.jsonl import iter_objects, read_text

FILE_OPTIONS = ("n", "data_source", "ability", "split")
ROW_SUFFIXES = (".parquet", ".jsonl", ".json")


@dataclass(frozen=True)
class SourceSpec:
    kind: str  # "synth" or "file"
    target: str  # task name or path
    options: dict[str, str] = field(default_factory=dict)
    text: str = ""

    def int_option(self, key: str, default: int | None = None) -> int | None:
        if key not in self.options:
            return default
        try:
            return int(self.options[key])
        except ValueError:
            raise AppoError(
                f"data spec {self.text!r}: option {key}={self.options[key]!r} is not an integer"
            ) from None


def _parse_options(query: str, text: str) -> dict[str, str]:
    options: dict[str, str] = {}
    for part in filter(None, query.split("&")):
        key, eq, value = part.partition("=")
        if not eq or not key:
            raise AppoError(f"data spec {text!r}: bad option {part!r} (expected key=value)")
        options[key.strip()] = value.strip()
    return options


def parse_spec(text: str) -> SourceSpec:
    """Parse a data source spec (see the module docstring for the grammar)."""
    text = str(text).strip()
    if not text:
        raise AppoError("empty data source spec")
    if text.startswith("synth:"):
        body = text[len("synth:") :]
        task, _, query = body.partition("?")
        if not task:
            raise AppoError(f"data spec {text!r}: missing task name after 'synth:'")
        return SourceSpec("synth", task, _parse_options(query, text), text)
    if Path(text).expanduser().exists() or "?" not in text:
        return SourceSpec("file", text, {}, text)
    path, _, query = text.partition("?")
    options = _parse_options(query, text)
    unknown = sorted(set(options) - set(FILE_OPTIONS))
    if unknown:
        raise AppoError(
            f"data spec {text!r}: unknown option(s) {', '.join(unknown)} for a file "
            f"(file options: {', '.join(FILE_OPTIONS)})"
        )
    return SourceSpec("file", path, options, text)


@dataclass(frozen=True)
class InMemoryRows:
    """Rows given in Python instead of a spec (`RLTrainer(train_data=...)`): `label` names
    them in messages (`train_data row 3: ...`) and is their default `data_source`."""

    label: str
    rows: tuple[dict[str, Any], ...]

    def __str__(self) -> str:
        return self.label


def rows_from_object(data: Any, label: str) -> InMemoryRows:
    """Rows in memory as `InMemoryRows`: a list (or tuple) of dicts, a pyarrow Table, a
    Hugging Face `datasets.Dataset` or a pandas DataFrame; anything else is one line."""
    if isinstance(data, InMemoryRows):
        return data
    if isinstance(data, str | bytes | dict) or data is None:
        rows = None
    elif hasattr(data, "to_pylist"):  # pyarrow.Table
        rows = data.to_pylist()
    elif hasattr(data, "to_list") and hasattr(data, "column_names"):  # datasets.Dataset
        rows = data.to_list()
    elif hasattr(data, "to_dict") and hasattr(data, "columns"):  # pandas.DataFrame
        rows = data.to_dict("records")
    elif isinstance(data, list | tuple):
        rows = list(data)
    else:
        rows = None
    if rows is None:
        raise AppoError(f"{label}: expected a list of dicts (or a pyarrow Table, a datasets."
                        f"Dataset, a pandas DataFrame), got {type(data).__name__}")
    if not rows:
        raise AppoError(f"{label}: no rows")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise AppoError(f"{label} row {i}: expected a dict of columns, got "
                            f"{type(row).__name__}")
    return InMemoryRows(label, tuple(rows))


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [row for _, row in iter_objects(path)]


def _read_json(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise AppoError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise AppoError(f"{path}: expected a JSON list of objects (one per example)")
    return data


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for corrupt files
        raise AppoError(f"{path}: cannot read parquet ({type(e).__name__}: {e})") from None


def _read_arrow(path: Path) -> list[dict[str, Any]]:
    """An Arrow file as written by `datasets.Dataset.save_to_disk` (IPC stream format)."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            try:
                table = pa.ipc.open_stream(source).read_all()
            except pa.ArrowInvalid:
                source.seek(0)
                table = pa.ipc.open_file(source).read_all()
    except Exception as e:  # noqa: BLE001
        raise AppoError(f"{path}: cannot read arrow data ({type(e).__name__}: {e})") from None
    return table.to_pylist()


def _read_hf_dataset_dir(path: Path, split: str | None) -> list[dict[str, Any]]:
    """A `save_to_disk` directory: a Dataset (state.json) or a DatasetDict (dataset_dict.json)."""
    dict_file = path / "dataset_dict.json"
    if dict_file.is_file():
        splits = json.loads(dict_file.read_text()).get("splits", [])
        chosen = split or ("train" if "train" in splits else (splits[0] if len(splits) == 1 else None))
        if chosen is None or chosen not in splits:
            raise AppoError(
                f"{path}: dataset has splits {', '.join(splits)}; choose one with "
                f"'{path}?split=NAME'"
            )
        return _read_hf_dataset_dir(path / chosen, None)
    state = json.loads((path / "state.json").read_text())
    files = [path / f["filename"] for f in state.get("_data_files", [])]
    if not files:
        files = sorted(path.glob("*.arrow"))
    return [row for f in files for row in _read_arrow(f)]


def _read_dir(path: Path, split: str | None) -> list[dict[str, Any]]:
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        return _read_hf_dataset_dir(path, split)
    # A hub-style snapshot: data files, possibly one set per split (train-0000.parquet, ...).
    files = sorted(p for p in path.rglob("*") if p.suffix in ROW_SUFFIXES and p.is_file())
    if not files:
        raise AppoError(
            f"{path}: directory holds no dataset (no dataset_dict.json / state.json and no "
            f"{', '.join(ROW_SUFFIXES)} files)"
        )
    wanted = split or "train"
    split_files = [p for p in files if p.name.startswith(wanted) or p.parent.name == wanted]
    if split_files:
        files = split_files
    elif split is not None:
        raise AppoError(f"{path}: no files for split {split!r}")
    return [row for f in files for row in read_rows(f)]


READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet,
           ".arrow": _read_arrow}


def read_rows(path: str | Path, split: str | None = None) -> list[dict[str, Any]]:
    """All rows of a data file or dataset directory, as dicts. Raises AppoError if empty."""
    path = Path(path).expanduser()
    if not path.exists():
        raise AppoError(f"data file not found: {path}")
    if path.is_dir():
        rows = _read_dir(path, split)
    elif path.suffix in READERS:
        rows = READERS[path.suffix](path)
    else:
        raise AppoError(
            f"{path}: unsupported data file type {path.suffix!r} "
            f"(use {', '.join(READERS)} or a Hugging Face dataset directory)"
        )
    if not rows:
        raise AppoError(f"{path}: no rows (empty data file)")
    return rows


def read_spec_rows(spec: SourceSpec) -> list[dict[str, Any]]:
    """Rows of a file spec, with its `n` option applied."""
    rows = read_rows(spec.target, spec.options.get("split"))
    n = spec.int_option("n")
    return rows[:n] if n is not None else rows
