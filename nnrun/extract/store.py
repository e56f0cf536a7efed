"""Read an extraction folder: per-prompt activations and token ids, memory-mapped from the shards.

Each shard's bytes are checked against the manifest's size and sha256 the first time the store
maps it (a read of one of its prompts, or `tokens()` reaching it), so damaged data is never
returned silently. Hashing reads the file once at about 1.5 GB/s, page-cached (0.07 s for a
99 MB folder), and the read that follows finds its pages in the cache.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open

from nnrun.extract.manifest import Manifest
from nnrun.extract.shards import TOKEN_IDS_KEY, activation_key
from nnrun.extract.stream import TokenActivationStream
from nnrun.extract.verify import Damage, DamagedFolderError, file_sha256, verify_folder

_MAX_OPEN_SHARDS = 64  # open safe_open handles kept; each holds a file descriptor and a mapping


VERIFY_ON_READ = "on_read"


def load_activations(out_dir: str | Path, verify: bool | Literal["on_read"] = VERIFY_ON_READ) -> "ActivationStore":
    """Open an extraction folder written by `nnrun.extract` (complete or not) for reading.

    `verify`: "on_read" (the default) checks each shard's size and sha256 the first time it is
    read, raising DamagedFolderError naming the file; True checks the whole folder now (every
    shard read in full, and the prompt table against them); False checks nothing.
    """
    if verify not in (True, False, VERIFY_ON_READ):
        raise ValueError(f"verify must be True, False or {VERIFY_ON_READ!r}, got {verify!r}")
    store = ActivationStore(out_dir, verify_on_read=verify == VERIFY_ON_READ)
    if verify is True:
        verify_folder(store.out_dir, store.manifest)
    return store


class ActivationStore:
    """The prompts of an extraction folder: `len(store)`, `store[i][module] -> [T, ...]`, `store.tokens(module)`.

    Only the shards listed in the manifest are read, so a folder whose job is still running or
    was killed shows the prompts of its complete shards. Reads go through `safe_open`, which
    memory-maps the files: only the rows asked for are read, and a store larger than RAM works.
    """

    def __init__(self, out_dir: str | Path, verify_on_read: bool = True) -> None:
        self.out_dir = Path(out_dir)
        self.verify_on_read = verify_on_read
        self._verified: set[int] = set()  # shards whose bytes matched the manifest (checked once per store)
        manifest = Manifest.load(self.out_dir)
        if manifest is None:
            raise FileNotFoundError(f"{self.out_dir} holds no extraction (no manifest.json)")
        self.manifest = manifest
        self.modules: list[str] = list(manifest.settings["modules"])
        self.positions: str = manifest.settings["positions"]
        self._handles: OrderedDict[int, Any] = OrderedDict()

    # ---- what the folder holds ---------------------------------------------------------------
    def __len__(self) -> int:
        return self.manifest.num_prompts

    def __getitem__(self, i: int) -> "PromptActivations":
        try:
            i = operator.index(i)
        except TypeError:
            raise TypeError(f"store index must be an int, got {type(i).__name__}") from None
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"prompt {i} out of range for a store of {len(self)} prompts")
        return PromptActivations(self, i)

    def __iter__(self) -> Iterator["PromptActivations"]:
        return (PromptActivations(self, i) for i in range(len(self)))

    @property
    def is_complete(self) -> bool:
        return self.manifest.is_complete

    @property
    def num_tokens(self) -> int:
        return self.manifest.num_tokens

    @property
    def num_shards(self) -> int:
        return len(self.manifest.shards)

    @property
    def skipped(self) -> list[dict[str, Any]]:
        """Input items left out under on_error="skip": {"index", "line", "reason"}."""
        return list(self.manifest.skipped)

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.manifest.settings["dtype"])

    def input_index(self, i: int) -> int:
        """Position in the input of the store's prompt i (they differ where items were skipped)."""
        return self.manifest.prompts["index"][i]

    # ---- reads -------------------------------------------------------------------------------
    def activations(self, i: int, module: str) -> torch.Tensor:
        """Prompt i's rows of one module: [T, ...] for positions="all", [1, ...] for "last"."""
        if module not in self.modules:
            raise KeyError(f"module {module!r} was not extracted; the store holds {self.modules}")
        prompts = self.manifest.prompts
        start = prompts["offset"][i]
        num_rows = prompts["num_tokens"][i] if self.positions == "all" else 1
        return self._shard(prompts["shard"][i]).get_slice(activation_key(module))[start : start + num_rows]

    def token_ids(self, i: int) -> torch.Tensor:
        """Prompt i's token ids: [T] int32."""
        prompts = self.manifest.prompts
        start = prompts["token_offset"][i]
        return self._shard(prompts["shard"][i]).get_slice(TOKEN_IDS_KEY)[start : start + prompts["num_tokens"][i]]

    def tokens(
        self, module: str, *, shuffle: bool = False, seed: int = 0, batch_size: int | None = None
    ) -> TokenActivationStream:
        """All rows of one module as a flat stream (a torch IterableDataset), optionally shuffled."""
        if module not in self.modules:
            raise KeyError(f"module {module!r} was not extracted; the store holds {self.modules}")
        files = [str(self.out_dir / shard.file) for shard in self.manifest.shards]
        return TokenActivationStream(
            files,
            activation_key(module),
            shuffle=shuffle,
            seed=seed,
            batch_size=batch_size,
            check_shard=self.check_shard if self.verify_on_read else None,
        )

    def check_shard(self, shard: int) -> None:
        """Raise DamagedFolderError unless the shard file has the manifest's size and sha256 (hashed once)."""
        if shard in self._verified:
            return
        check_shard_file(self.out_dir, self.manifest.shards[shard], shard)
        self._verified.add(shard)

    def _shard(self, shard: int) -> Any:
        handle = self._handles.get(shard)
        if handle is None:
            if self.verify_on_read:
                self.check_shard(shard)
            handle = safe_open(str(self.out_dir / self.manifest.shards[shard].file), framework="pt")
            self._handles[shard] = handle
            if len(self._handles) > _MAX_OPEN_SHARDS:
                self._handles.popitem(last=False)
        else:
            self._handles.move_to_end(shard)
        return handle

    def __getstate__(self) -> dict:
        # DataLoader workers pickle the store: open handles stay behind, each process opens its own.
        return {**self.__dict__, "_handles": OrderedDict()}

    def __repr__(self) -> str:
        state = "complete" if self.is_complete else "incomplete"
        return (
            f"ActivationStore({str(self.out_dir)!r}, {len(self)} prompts, {self.num_tokens} tokens, "
            f"modules={self.modules}, positions={self.positions!r}, {state})"
        )


class PromptActivations(Mapping):
    """One prompt's activations by module name, read on access; plus its token ids."""

    def __init__(self, store: ActivationStore, i: int) -> None:
        self._store = store
        self.i = i

    def __getitem__(self, module: str) -> torch.Tensor:
        return self._store.activations(self.i, module)

    def __iter__(self) -> Iterator[str]:
        return iter(self._store.modules)

    def __contains__(self, module: object) -> bool:
        return module in self._store.modules  # without reading the tensor, as Mapping's default would

    def __len__(self) -> int:
        return len(self._store.modules)

    @property
    def token_ids(self) -> torch.Tensor:
        return self._store.token_ids(self.i)

    @property
    def input_index(self) -> int:
        return self._store.input_index(self.i)

    @property
    def num_tokens(self) -> int:
        return self._store.manifest.prompts["num_tokens"][self.i]

    def __repr__(self) -> str:
        return f"PromptActivations(prompt {self.i}, input index {self.input_index}, {self.num_tokens} tokens)"


def check_shard_file(out_dir: Path, info: Any, shard: int) -> None:
    """Raise DamagedFolderError unless shard `shard` (`info`: its manifest entry) has the listed size and sha256."""
    path = out_dir / info.file
    problem = None
    if not path.is_file():
        problem = "is missing"
    elif (size := path.stat().st_size) != info.num_bytes:
        problem = f"has {size} bytes, the manifest lists {info.num_bytes}"
    elif (sha256 := file_sha256(path)) != info.sha256:
        problem = (
            f"has sha256 {sha256[:16]}..., the manifest lists {info.sha256[:16]}...: its bytes changed "
            "after it was written"
        )
    if problem is not None:
        raise DamagedFolderError(out_dir, [Damage(info.file, problem, shard)])
