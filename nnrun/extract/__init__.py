"""Batch activation extraction: `nnrun.extract(...)` / `nnrun extract ...` and `nnrun.load_activations(dir)`."""

from __future__ import annotations

import sys
import types
from typing import Any

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


class _CallableModule(types.ModuleType):
    """Lets `nnrun.extract(...)` work once this package is imported.

    Importing the package `nnrun.extract` binds the attribute `nnrun.extract` to the package,
    shadowing the lazily exported function of the same name; calling the package calls it.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> ExtractionSummary:
        return extract(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = [
    "DEFAULT_SHARD_TOKENS",
    "ActivationStore",
    "DamagedFolderError",
    "ExtractionExecutor",
    "ExtractionOptions",
    "ExtractionRequest",
    "ExtractionSummary",
    "LocalExecutor",
    "FolderRepairWarning",
    "InputError",
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
