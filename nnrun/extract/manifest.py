"""The manifest of an extraction folder: settings, complete shards, per-prompt rows, skipped items.

It is the folder's commit record. Shards not listed in it do not exist as far as readers and
resumes are concerned, and it is only ever replaced whole (temp file + fsync + os.replace), so
a kill at any moment leaves either the previous manifest or the new one. Its text is a pure
function of its content (sorted keys, no timestamps), so a resumed job writes the same bytes as
an uninterrupted one.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MANIFEST_NAME = "manifest.json"
FORMAT = "nnrun-activations/1"
PROMPT_COLUMNS = ("index", "num_tokens", "shard", "offset", "token_offset")


class SettingsMismatchError(ValueError):
    """The folder holds an extraction made with other settings; continuing would mix the two."""


@dataclass(frozen=True)
class ShardInfo:
    """One complete shard file."""

    file: str
    num_prompts: int
    num_tokens: int  # token ids stored (every prompt token)
    num_rows: int  # activation rows per module (= num_tokens for positions="all", num_prompts for "last")
    num_bytes: int
    sha256: str

    def __post_init__(self) -> None:
        if min(self.num_prompts, self.num_tokens, self.num_rows, self.num_bytes) < 0:
            raise ValueError(f"ShardInfo counts must be non-negative, got {self}")


@dataclass
class Manifest:
    """What an extraction folder holds; see the module docstring for the commit protocol."""

    settings: dict[str, Any]  # everything that shapes the data; a resume must match it exactly
    model: dict[str, Any]  # descriptive: name, class, device
    shards: list[ShardInfo] = field(default_factory=list)
    prompts: dict[str, list[int]] = field(default_factory=lambda: {c: [] for c in PROMPT_COLUMNS})
    skipped: list[dict[str, Any]] = field(default_factory=list)  # {"index", "line", "reason"}
    activation_shapes: dict[str, list[int]] = field(default_factory=dict)  # module -> per-row shape, e.g. [H]
    num_consumed: int = 0  # input records covered by the shards and skipped (where a resume continues)
    input_sha256: str = ""  # InputHasher digest of those records
    is_complete: bool = False

    def __post_init__(self) -> None:
        if sorted(self.prompts) != sorted(PROMPT_COLUMNS):
            raise ValueError(f"Manifest.prompts must have the columns {PROMPT_COLUMNS}, got {sorted(self.prompts)}")
        if len({len(column) for column in self.prompts.values()}) > 1:
            raise ValueError("Manifest.prompts columns must have equal lengths")
        if self.num_consumed < 0:
            raise ValueError(f"Manifest.num_consumed must be non-negative, got {self.num_consumed}")

    @property
    def num_prompts(self) -> int:
        return len(self.prompts["index"])

    @property
    def num_tokens(self) -> int:
        return sum(shard.num_tokens for shard in self.shards)

    def add_prompt(self, index: int, num_tokens: int, shard: int, offset: int, token_offset: int) -> None:
        row = (index, num_tokens, shard, offset, token_offset)
        for column, value in zip(PROMPT_COLUMNS, row):
            self.prompts[column].append(value)

    def rewind(self, num_shards: int, num_consumed: int, input_sha256: str) -> None:
        """Forget the shards from `num_shards` on and the input items from `num_consumed` on (an earlier commit).

        `num_consumed` must lie after the last kept shard's prompts and no later than the next
        shard's first one, and `input_sha256` must be the InputHasher digest of that many records
        ("" for none, as in a new manifest).
        """
        if not 0 <= num_shards <= len(self.shards):
            raise ValueError(f"cannot rewind {len(self.shards)} shards to {num_shards}")
        num_rows = sum(shard.num_prompts for shard in self.shards[:num_shards])
        if num_rows and self.prompts["index"][num_rows - 1] >= num_consumed:
            raise ValueError(f"rewinding to {num_consumed} input items would drop prompts of the kept shards")
        self.shards = self.shards[:num_shards]
        self.prompts = {column: values[:num_rows] for column, values in self.prompts.items()}
        self.skipped = [item for item in self.skipped if item["index"] < num_consumed]
        if not self.shards:
            self.activation_shapes = {}  # as before the first shard, so the commits that follow write the same text
        self.num_consumed = num_consumed
        self.input_sha256 = input_sha256
        self.is_complete = False

    def to_text(self) -> str:
        """Deterministic JSON: one top-level key per line, sorted, values compact."""
        data = asdict(self)
        data["format"] = FORMAT
        lines = [
            f"{json.dumps(key)}: {json.dumps(data[key], sort_keys=True, separators=(',', ':'))}" for key in sorted(data)
        ]
        return "{\n" + ",\n".join(lines) + "\n}\n"

    @classmethod
    def from_text(cls, text: str, where: str = MANIFEST_NAME) -> "Manifest":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is not valid JSON: {e}") from None
        if not isinstance(data, dict) or data.pop("format", None) != FORMAT:
            raise ValueError(f"{where} is not an nnrun activation manifest (format {FORMAT!r})")
        try:
            data["shards"] = [ShardInfo(**shard) for shard in data["shards"]]
            return cls(**data)
        except (KeyError, TypeError) as e:  # an edited manifest: a missing, unknown or mistyped field
            raise ValueError(f"{where} is not a valid nnrun activation manifest ({type(e).__name__}: {e})") from None

    def save(self, directory: Path) -> None:
        """Replace the manifest atomically."""
        write_atomic(Path(directory) / MANIFEST_NAME, self.to_text().encode())

    @classmethod
    def load(cls, directory: Path) -> "Manifest | None":
        """The folder's manifest, or None when it has none."""
        path = Path(directory) / MANIFEST_NAME
        if not path.exists():
            return None
        return cls.from_text(path.read_text(encoding="utf-8"), str(path))


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to a temp file beside `path`, fsync it, then rename it over `path`."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def settings_diff(stored: dict[str, Any], wanted: dict[str, Any], prefix: str = "") -> list[str]:
    """Human-readable differences between two settings dicts, e.g. "positions: stored 'all', now 'last'"."""
    diffs = []
    for key in sorted(set(stored) | set(wanted)):
        name = f"{prefix}{key}"
        old, new = stored.get(key), wanted.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            diffs.extend(settings_diff(old, new, f"{name}."))
        elif old != new:
            diffs.append(f"{name}: stored {old!r}, now {new!r}")
    return diffs
