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
    text_field: str
    limit: int | None
    _read: Any  # () -> Iterator[PromptRecord]
    num_items: int | None = None  # known up front for sized inputs, for the progress bar

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"limit must be non-negative, got {self.limit}")
        if not self.text_field:
            raise ValueError("text_field must name a field, got ''")

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
        if text_field is None or text_field not in value:
            return None, f"missing text field {text_field!r} (fields: {', '.join(map(str, value)) or 'none'})"
        value = value[text_field]
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


def open_prompts(prompts: Any, *, text_field: str = "text", limit: int | None = None) -> PromptSource:
    """Wrap an iterable of prompts, or open a .txt/.jsonl/.parquet file or a saved HF dataset folder."""
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


def _open_path(path: Path, text_field: str, limit: int | None) -> PromptSource:
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


def _iterable_records(prompts: Iterable[Any], text_field: str) -> Iterator[PromptRecord]:
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


def _jsonl_records(path: Path, text_field: str) -> Iterator[PromptRecord]:
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


def _open_parquet(path: Path, text_field: str, limit: int | None) -> PromptSource:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    _check_column(path.name, text_field, parquet.schema_arrow.names)

    def read() -> Iterator[PromptRecord]:
        batches = pq.ParquetFile(path).iter_batches(batch_size=_BATCH_ROWS, columns=[text_field])
        values = itertools.chain.from_iterable(b.column(0).to_pylist() for b in batches)
        for index, value in enumerate(values):
            yield _record(index, f"{path.name} record {index}", value, None)

    return PromptSource("parquet", path.name, text_field, limit, read, parquet.metadata.num_rows)


def _open_dataset(path: Path, text_field: str, limit: int | None) -> PromptSource:
    import datasets

    try:
        dataset = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise InputError(f"input folder {path.name!r} is not a saved HF dataset ({e})") from None
    if isinstance(dataset, datasets.DatasetDict):
        if len(dataset) != 1:
            raise InputError(f"dataset {path.name!r} has splits {sorted(dataset)}; pass the folder of one split")
        dataset = next(iter(dataset.values()))
    _check_column(path.name, text_field, dataset.column_names)
    column = dataset.select_columns([text_field])

    def read() -> Iterator[PromptRecord]:
        batches = column.iter(batch_size=_BATCH_ROWS)
        values = itertools.chain.from_iterable(b[text_field] for b in batches)
        for index, value in enumerate(values):
            yield _record(index, f"{path.name} record {index}", value, None)

    return PromptSource("dataset", path.name, text_field, limit, read, len(dataset))


def _check_column(name: str, text_field: str, columns: list[str]) -> None:
    # A missing column is wrong for every record at once, so it is an error of the whole input.
    if text_field not in columns:
        raise InputError(
            f"{name}: missing text field {text_field!r} (columns: {', '.join(columns)}); choose one with --text-field"
        )
