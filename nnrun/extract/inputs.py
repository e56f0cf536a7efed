"""Prompt sources for extraction: iterables, .txt, .jsonl, .parquet and saved HF datasets.

Every source yields `PromptRecord`s in input order, one per item, each carrying where it came
from ("prompts.jsonl line 7") so a bad item can be reported precisely. A bad item is not raised
here: it is a record with `error` set, and the job decides whether to stop or skip it.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Prompt = str | list[int]

_BATCH_ROWS = 1024  # rows per read from columnar sources
# Without a text field named, a record's prompt is its first field of these (vLLM's prompt dict
# spells it "prompt", datasets mostly "text"), else its only string field.
DEFAULT_TEXT_FIELDS = ("prompt", "text")
MISSING_FIELD = "missing text field"  # how a record without its prompt field is reported
_NAME_FIELD = "name the field that holds the prompt with --text-field NAME (text_field=NAME in Python)"


class InputError(ValueError):
    """An input item (or the whole input) cannot be used; the message names the line or record."""


@dataclass(frozen=True)
class PromptRecord:
    """One input item: its 0-based position, where it came from, and its prompt or what is wrong with it."""

    index: int
    location: str  # "prompts.txt line 7", "data.parquet record 6", "item 6"
    prompt: Prompt | None
    error: str | None = None  # set exactly when prompt is None
    line: int | None = None  # 1-based line number for line-oriented files

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.error is None):
            raise ValueError("PromptRecord needs exactly one of prompt and error")


@dataclass(frozen=True)
class PromptSource:
    """A re-readable input: `records()` starts from the first item each time it is called."""

    kind: str  # "iterable", "txt", "jsonl", "parquet" or "dataset"
    name: str  # file name for messages
    text_field: str | None  # None: each record's DEFAULT_TEXT_FIELDS, else its only string field
    limit: int | None
    _read: Any  # () -> Iterator[PromptRecord]
    num_items: int | None = None  # known up front for sized inputs, for the progress bar

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"limit must be non-negative, got {self.limit}")
        if self.text_field is not None and not self.text_field:
            raise ValueError("text_field must name a field (or be None for the default fields), got ''")

    def records(self) -> Iterator[PromptRecord]:
        """Records in input order, at most `limit` of them."""
        return itertools.islice(self._read(), self.limit)

    @property
    def total(self) -> int | None:
        """Number of records `records()` yields, when known without reading the input."""
        if self.num_items is None:
            return self.limit
        return self.num_items if self.limit is None else min(self.num_items, self.limit)


def check_prompt(value: Any, text_field: str | None = None) -> tuple[Prompt | None, str | None]:
    """Return (prompt, None) for a usable value or (None, reason) for a bad one."""
    if isinstance(value, dict):
        field = record_field(value, text_field)
        if field is None:
            return None, _missing_field(text_field, list(value))
        value = value[field]
    if isinstance(value, str):
        if not value.strip():
            return None, "empty prompt"
        problem = _unicode_problem(value)
        return (None, problem) if problem else (value, None)
    if isinstance(value, (list, tuple)):
        if not value:
            return None, "empty token id list"
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
            return None, "a token id list must hold non-negative integers only"
        return list(value), None
    if value is None:
        return None, "missing value (null)"
    return None, f"expected a string or a list of token ids, got {type(value).__name__}"


def record_field(record: dict, text_field: str | None) -> Any:
    """The key of `record` that holds the prompt: `text_field`, else a default field, else the only string field."""
    if text_field is not None:
        return text_field if text_field in record else None
    return _default_field(list(record), [key for key, value in record.items() if isinstance(value, str)])


def _default_field(fields: list[Any], string_fields: list[Any]) -> Any:
    found = next((name for name in DEFAULT_TEXT_FIELDS if name in fields), None)
    if found is None and len(string_fields) == 1:
        return string_fields[0]
    return found


def _missing_field(text_field: str | None, fields: list[Any], noun: str = "field") -> str:
    listed = ", ".join(map(str, fields)) or "none"
    if text_field is not None:
        return f"{MISSING_FIELD} {text_field!r} ({noun}s: {listed}); {_NAME_FIELD}"
    wanted = " or ".join(repr(name) for name in DEFAULT_TEXT_FIELDS)
    return f"{MISSING_FIELD} {wanted}, and not one string {noun} to use instead ({noun}s: {listed}); {_NAME_FIELD}"


def _unicode_problem(text: str) -> str | None:
    """Why `text` is not valid Unicode, or None."""
    # A str can hold lone surrogates (from a JSON escape such as "\\udcff", or from os.fsdecode of
    # undecodable bytes); no tokenizer can encode them, so such an item is bad like an empty one.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return (
            f"the text holds a lone surrogate {text[error.start]!r} at character {error.start}, "
            "which is not valid Unicode (it has no UTF-8 encoding)"
        )
    return None


def open_prompts(prompts: Any, *, text_field: str | None = None, limit: int | None = None) -> PromptSource:
    """Wrap an iterable of prompts, or open a .txt/.jsonl/.parquet file or a saved HF dataset folder.

    Records (dicts, rows) hold their prompt in `text_field`; None: "prompt", else "text", else their only
    string field (for a columnar input, its only string column).
    """
    if isinstance(prompts, (str, os.PathLike)):
        return _open_path(Path(prompts), text_field, limit)
    if isinstance(prompts, PromptSource):
        return prompts
    if not isinstance(prompts, Iterable):
        raise TypeError(f"prompts must be an iterable of prompts or a path, got {type(prompts).__name__}")
    num_items = len(prompts) if hasattr(prompts, "__len__") else None
    return PromptSource(
        "iterable", "prompts", text_field, limit, lambda: _iterable_records(prompts, text_field), num_items
    )


def _open_path(path: Path, text_field: str | None, limit: int | None) -> PromptSource:
    if not path.exists():
        raise InputError(
            f"input {str(path)!r} does not exist (prompts are a list of strings or token id "
            "lists, or the path of a file or dataset folder)"
        )
    if path.is_dir():
        return _open_dataset(path, text_field, limit)
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return PromptSource("txt", path.name, text_field, limit, lambda: _txt_records(path), _count_lines(path))
    if suffix == ".jsonl":
        return PromptSource(
            "jsonl", path.name, text_field, limit, lambda: _jsonl_records(path, text_field), _count_lines(path)
        )
    if suffix == ".parquet":
        return _open_parquet(path, text_field, limit)
    raise InputError(
        f"input {path.name!r}: unknown format {suffix or '(none)'!r}; "
        "use .txt, .jsonl, .parquet or a saved HF dataset folder"
    )


def _iterable_records(prompts: Iterable[Any], text_field: str | None) -> Iterator[PromptRecord]:
    for index, value in enumerate(prompts):
        yield _record(index, f"item {index}", value, text_field)


def _record(index: int, location: str, value: Any, text_field: str | None, line: int | None = None) -> PromptRecord:
    prompt, error = check_prompt(value, text_field)
    return PromptRecord(index, location, prompt, error, line)


def _count_lines(path: Path) -> int:
    """Lines as `_lines` yields them (a last line without a newline counts), at C speed."""
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, line without its newline); a decoding error names its line."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                yield line_no, raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                raise InputError(f"{path.name} line {line_no}: not valid UTF-8 ({e.reason})") from None


def _txt_records(path: Path) -> Iterator[PromptRecord]:
    for line_no, line in _lines(path):
        yield _record(line_no - 1, f"{path.name} line {line_no}", line, None, line_no)


def _jsonl_records(path: Path, text_field: str | None) -> Iterator[PromptRecord]:
    for line_no, line in _lines(path):
        index, location = line_no - 1, f"{path.name} line {line_no}"
        if not line.strip():
            yield PromptRecord(index, location, None, "empty line", line_no)
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            yield PromptRecord(index, location, None, f"invalid JSON ({e.msg})", line_no)
            continue
        if not isinstance(value, dict):
            yield PromptRecord(index, location, None, f"expected a JSON object, got {type(value).__name__}", line_no)
            continue
        yield _record(index, location, value, text_field, line_no)


def _open_parquet(path: Path, text_field: str | None, limit: int | None) -> PromptSource:
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    schema = parquet.schema_arrow
    strings = [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
    column = _column(path.name, text_field, schema.names, strings)

    def read() -> Iterator[PromptRecord]:
        batches = pq.ParquetFile(path).iter_batches(batch_size=_BATCH_ROWS, columns=[column])
        values = itertools.chain.from_iterable(b.column(0).to_pylist() for b in batches)
        for index, value in enumerate(values):
            yield _record(index, f"{path.name} record {index}", value, None)

    return PromptSource("parquet", path.name, text_field, limit, read, parquet.metadata.num_rows)


def _open_dataset(path: Path, text_field: str | None, limit: int | None) -> PromptSource:
    import datasets

    try:
        dataset = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise InputError(f"input folder {path.name!r} is not a saved HF dataset ({e})") from None
    if isinstance(dataset, datasets.DatasetDict):
        if len(dataset) != 1:
            raise InputError(f"dataset {path.name!r} has splits {sorted(dataset)}; pass the folder of one split")
        dataset = next(iter(dataset.values()))
    strings = [name for name, f in dataset.features.items() if getattr(f, "dtype", None) in ("string", "large_string")]
    column = _column(path.name, text_field, dataset.column_names, strings)
    selected = dataset.select_columns([column])

    def read() -> Iterator[PromptRecord]:
        batches = selected.iter(batch_size=_BATCH_ROWS)
        values = itertools.chain.from_iterable(b[column] for b in batches)
        for index, value in enumerate(values):
            yield _record(index, f"{path.name} record {index}", value, None)

    return PromptSource("dataset", path.name, text_field, limit, read, len(dataset))


def _column(name: str, text_field: str | None, columns: list[str], string_columns: list[str]) -> str:
    """The column that holds the prompts (see `record_field`); the settings keep `text_field` as given."""
    found = _default_field(columns, string_columns) if text_field is None else text_field
    if found not in columns:  # wrong for every record at once, so it is an error of the whole input
        raise InputError(f"{name}: {_missing_field(text_field, columns, 'column')}")
    return found
