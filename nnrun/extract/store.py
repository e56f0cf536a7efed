"""Read an extraction folder: per-prompt activations and token ids, memory-mapped from the shards."""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from nnrun.extract.manifest import Manifest
from nnrun.extract.shards import TOKEN_IDS_KEY, activation_key
from nnrun.extract.stream import TokenActivationStream
from nnrun.extract.verify import verify_folder

_MAX_OPEN_SHARDS = 64  # open safe_open handles kept; each holds a file descriptor and a mapping


def load_activations(out_dir: str | Path, verify: bool = False) -> "ActivationStore":
    """Open an extraction folder written by `nnrun.extract` (complete or not) for reading.

    `verify=True` first reads every shard in full and checks it against the manifest (size,
    sha256, the prompt table's offsets), raising DamagedFolderError that names each bad file.
    """
    store = ActivationStore(out_dir)
    if verify:
        verify_folder(store.out_dir, store.manifest)
    return store


class ActivationStore:
    """The prompts of an extraction folder: `len(store)`, `store[i][module] -> [T, ...]`, `store.tokens(module)`.

    Only the shards listed in the manifest are read, so a folder whose job is still running or
    was killed shows the prompts of its complete shards. Reads go through `safe_open`, which
    memory-maps the files: only the rows asked for are read, and a store larger than RAM works.
    """

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = Path(out_dir)
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

    def tokens(self, module: str, *, shuffle: bool = False, seed: int = 0,
               batch_size: int | None = None) -> TokenActivationStream:
        """All rows of one module as a flat stream (a torch IterableDataset), optionally shuffled."""
        if module not in self.modules:
            raise KeyError(f"module {module!r} was not extracted; the store holds {self.modules}")
        files = [str(self.out_dir / shard.file) for shard in self.manifest.shards]
        return TokenActivationStream(files, activation_key(module), shuffle=shuffle, seed=seed, batch_size=batch_size)

    def _shard(self, shard: int) -> Any:
        handle = self._handles.get(shard)
        if handle is None:
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
        return (f"ActivationStore({str(self.out_dir)!r}, {len(self)} prompts, {self.num_tokens} tokens, "
                f"modules={self.modules}, positions={self.positions!r}, {state})")


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
