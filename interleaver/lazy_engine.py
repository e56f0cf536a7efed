"""A LanguageModel's engine, built at its first trace or generate, as nnsight dispatches.

nnsight's LanguageModel builds a checkpoint's module tree on the meta device and loads the weights
at the first trace (`dispatch`). nnrun does the same for a checkpoint it is given by name (a folder,
a hub id or a bundled name) without `dispatch=True`: the constructor reads the config and the
tokenizer and builds the tree on the meta device, so construction is fast, and `scan`, printing the
tree, attaching modules and `edit()` need no weights. The first `trace`/`generate` (or `.engine`,
or `dispatch()`) builds the engine, which loads the weights; the client tree is then pointed at the
engine's modules (`Envoy._update`, nnsight's own swap), and the modules a user attached to the meta
tree meanwhile are attached to the engine's model at the same paths first, so they are kept.

`EngineSlot` is shared by a model and its edited copies (`model.edit()` makes a shallow copy), so
whichever traces first builds the one engine for all of them. The build is under a lock: many
threads may trace at once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from interleaver.attach import mirror_on_engine
from nnrun.config import EngineConfig
from nnrun.engine import LLM
from nnrun.loader import _load_tokenizer, _refuse_before_building, _resolve_path


@dataclass
class EngineRecipe:
    """What `LLM(...)` is called with when the engine is built."""

    model_or_path: Any  # a checkpoint's name, or an in-memory model (built at once)
    device: str
    dtype: Any
    runner_cls: type
    options: dict = field(default_factory=dict)

    def build(self, tokenizer: Any) -> LLM:
        return LLM(
            self.model_or_path,
            tokenizer=tokenizer,
            device=self.device,
            dtype=self.dtype,
            runner_cls=self.runner_cls,
            **self.options,
        )


@dataclass
class MetaModel:
    """A checkpoint's module tree on the meta device (no weights) and its tokenizer."""

    module: torch.nn.Module
    tokenizer: Any
    built_ids: set[int]  # the modules HF built: any other module in the tree was attached by the user


class EngineSlot:
    """The engine of a model and its edited copies: present from the start, or built on first use."""

    def __init__(self, engine: LLM | None = None, recipe: EngineRecipe | None = None) -> None:
        self.engine = engine
        self.recipe = recipe
        self.meta: MetaModel | None = None
        self._lock = threading.Lock()

    def get(self, model: Any) -> LLM:
        """The engine; the first call builds it and points `model`'s tree at its modules."""
        engine = self.engine
        if engine is None:
            with self._lock:
                if self.engine is None:
                    self.engine = _dispatch(model, self.recipe, self.meta)
                    self.meta = None  # the meta tree is no longer referenced: free it
            engine = self.engine
        if model.__dict__.get("_module") is not engine.model:  # an edited copy's root, built before the swap
            object.__setattr__(model, "_module", engine.model)
        return engine


def open_slot(recipe: EngineRecipe, tokenizer: Any, lazy: bool) -> tuple[EngineSlot, torch.nn.Module, Any, Any]:
    """A model's engine slot, and the module tree, tokenizer and engine interleaver its client tree starts with."""
    if lazy:
        slot = EngineSlot(recipe=recipe)
        slot.meta = build_meta_model(recipe.model_or_path, tokenizer, recipe)
        return slot, slot.meta.module, slot.meta.tokenizer, None
    engine = recipe.build(tokenizer)
    return EngineSlot(engine=engine), engine.model, engine.tokenizer, engine.runner.interleaver


def build_meta_model(model_or_path: str, tokenizer: Any, recipe: EngineRecipe) -> MetaModel:
    """The checkpoint's config and tokenizer, and its module tree on the meta device; the options are checked now."""
    config = EngineConfig.from_kwargs(
        model_or_path, tokenizer, device=recipe.device, dtype=recipe.dtype, **recipe.options
    )  # an unknown or invalid engine option is refused here, not at the first trace
    path = _resolve_path(model_or_path)
    model_config = config.model
    try:
        hf_config = AutoConfig.from_pretrained(
            path, revision=model_config.revision, trust_remote_code=model_config.trust_remote_code
        )
    except OSError as error:
        raise ValueError(
            f"could not load model {model_or_path!r}: it is not a local checkpoint folder, not a bundled model "
            f"(tiny-facts, tiny-facts-gpt2), and the HF hub did not provide it (not in the local cache, "
            f"or no network): {error}"
        ) from error
    _refuse_before_building(hf_config)  # a family nnrun cannot serve is refused at construction, as before
    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(
            hf_config, dtype=config.device.torch_dtype, trust_remote_code=model_config.trust_remote_code
        )
    module.eval()
    tokenizer = _load_tokenizer(tokenizer, path, model_config)
    return MetaModel(module, tokenizer, {id(m) for m in module.modules()})


def _dispatch(model: Any, recipe: EngineRecipe, meta: MetaModel) -> LLM:
    engine = recipe.build(model.tokenizer)
    attached = _attached_modules(meta)
    for parent_path, name, module in attached:
        setattr(engine.model.get_submodule(parent_path), name, module)
    model.interleaver.engine_interleaver = engine.runner.interleaver
    model._update(engine.model)  # nnsight's swap: every client envoy now wraps the engine's module
    for parent_path, name, module in attached:
        mirror_on_engine(_envoy_at(model, parent_path), name, module)
    return engine


def _attached_modules(meta: MetaModel) -> list[tuple[str, str, torch.nn.Module]]:
    """(parent path, name, module) of each module attached to the meta tree, outermost first."""
    attached = []
    for path, module in meta.module.named_modules():
        if id(module) in meta.built_ids or not path:
            continue
        parent_path, _, name = path.rpartition(".")
        if id(meta.module.get_submodule(parent_path)) in meta.built_ids:
            attached.append((parent_path, name, module))
    return attached


def _envoy_at(root: Any, module_path: str) -> Any:
    envoy = root
    for name in filter(None, module_path.split(".")):
        envoy = envoy._child_map[name] if name in envoy._child_map else getattr(envoy, name)
    return envoy
