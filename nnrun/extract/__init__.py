"""Batch activation extraction: `nnrun.extract(...)` / `nnrun extract ...` and `nnrun.load_activations(dir)`.

The names below are imported on first use: `nnrun extract --help` (nnrun.extract.command) and the
modules that need one piece (tensor parallelism: `hooks`) load no more than they use.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nnrun.extract.executors import ExtractionExecutor, ExtractionRequest, LocalExecutor, extract
    from nnrun.extract.hooks import ModuleSpec, resolve_modules
    from nnrun.extract.inputs import InputError, PromptRecord, PromptSource, open_prompts
    from nnrun.extract.job import DEFAULT_SHARD_TOKENS, ExtractionOptions
    from nnrun.extract.manifest import Manifest, SettingsMismatchError
    from nnrun.extract.progress import ExtractionSummary
    from nnrun.extract.resume import FolderRepairWarning
    from nnrun.extract.shards import ShardWriteError
    from nnrun.extract.store import ActivationStore, PromptActivations, load_activations
    from nnrun.extract.stream import TokenActivationStream
    from nnrun.extract.verify import DamagedFolderError

# module of this package -> the public names it defines
_EXPORTS = {
    "executors": ("ExtractionExecutor", "ExtractionRequest", "LocalExecutor", "extract"),
    "hooks": ("ModuleSpec", "resolve_modules"),
    "inputs": ("InputError", "PromptRecord", "PromptSource", "open_prompts"),
    "job": ("DEFAULT_SHARD_TOKENS", "ExtractionOptions"),
    "manifest": ("Manifest", "SettingsMismatchError"),
    "progress": ("ExtractionSummary",),
    "resume": ("FolderRepairWarning",),
    "shards": ("ShardWriteError",),
    "store": ("ActivationStore", "PromptActivations", "load_activations"),
    "stream": ("TokenActivationStream",),
    "verify": ("DamagedFolderError",),
}
_NAME_TO_MODULE = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> Any:
    if name not in _NAME_TO_MODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_NAME_TO_MODULE[name]}"), name)
    globals()[name] = value
    return value


class _CallableModule(types.ModuleType):
    """Lets `nnrun.extract(...)` work once this package is imported.

    Importing the package `nnrun.extract` binds the attribute `nnrun.extract` to the package,
    shadowing the lazily exported function of the same name; calling the package calls it.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> ExtractionSummary:
        return __getattr__("extract")(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = [
    "DEFAULT_SHARD_TOKENS",
    "ActivationStore",
    "DamagedFolderError",
    "ExtractionExecutor",
    "ExtractionOptions",
    "ExtractionRequest",
    "ExtractionSummary",
    "FolderRepairWarning",
    "InputError",
    "LocalExecutor",
    "Manifest",
    "ModuleSpec",
    "PromptActivations",
    "PromptRecord",
    "PromptSource",
    "SettingsMismatchError",
    "ShardWriteError",
    "TokenActivationStream",
    "extract",
    "load_activations",
    "open_prompts",
    "resolve_modules",
]
