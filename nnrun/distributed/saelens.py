"""Export one module of an extraction folder as SAELens's cached-activations input.

SAELens (`sae-lens`) reads cached activations with `datasets.load_from_disk(path)`: a saved HF
dataset with one column named after the hook, `Array2D(shape=(context_size, d_in))` per row,
and optionally `token_ids`, `Sequence(int32, length=context_size)`. Each row is one context of
`context_size` consecutive tokens. An nnrun folder stores prompts of any length back to back, so
the export cuts that token stream, in input order, into contexts of `context_size` rows and
leaves out the last, shorter one (SAELens shuffles rows itself, in its mixing buffer). Arrow has
no bfloat16: bfloat16 activations are written as float32.

The format is Arrow, not safetensors, so this is a copy. To train without one, feed
`TokenDataset` batches straight to SAELens's `SAETrainer` (its data provider is any iterator
of `[batch, d_in]` tensors).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from nnrun.extract.store import ActivationStore, load_activations

_ARROW_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "float32"}


@dataclass(frozen=True)
class SaelensExport:
    """What an export wrote: the folder to pass as SAELens's `cached_activations_path`, and its shape."""

    path: str
    hook_name: str  # the column: SAELens's `hook_name`
    context_size: int
    d_in: int
    num_contexts: int
    num_dropped_tokens: int  # the tokens after the last whole context


def export_saelens(
    store: ActivationStore | str | Path,
    module: str,
    out_dir: str | Path,
    *,
    context_size: int,
    hook_name: str | None = None,
    contexts_per_write: int = 256,
) -> SaelensExport:
    """Write `module`'s rows of a (complete or not) folder as a SAELens cached-activations dataset at `out_dir`."""
    import datasets

    store = store if isinstance(store, ActivationStore) else load_activations(store)
    if module not in store.modules:
        raise KeyError(f"module {module!r} was not extracted; the store holds {store.modules}")
    if store.positions != "all":
        raise ValueError(
            "SAELens trains on every token's activation; this folder holds only each prompt's last (positions='last')"
        )
    if context_size <= 0:
        raise ValueError(f"context_size must be positive, got {context_size}")
    shape = store.manifest.activation_shapes.get(module, [])
    if len(shape) != 1:
        raise ValueError(f"SAELens wants one vector per token; {module} stores rows of shape {shape}")
    hook_name = hook_name or module
    d_in, dtype = shape[0], _ARROW_DTYPES.get(store.dtype)
    if dtype is None:
        raise ValueError(f"no Arrow dtype for {store.dtype}")
    features = datasets.Features(
        {
            hook_name: datasets.Array2D(shape=(context_size, d_in), dtype=dtype),
            "token_ids": datasets.Sequence(datasets.Value("int32"), length=context_size),
        }
    )
    parts = []
    for chunk in _chunks(_contexts(store, module, context_size), contexts_per_write):
        activations = torch.stack([c[0] for c in chunk]).to(getattr(torch, dtype))  # [n, context_size, d_in]
        token_ids = torch.stack([c[1] for c in chunk])  # [n, context_size]
        parts.append(
            datasets.Dataset.from_dict(
                {hook_name: activations.numpy(), "token_ids": token_ids.numpy()}, features=features
            )
        )
    dataset = (
        datasets.concatenate_datasets(parts)
        if parts
        else datasets.Dataset.from_dict({hook_name: [], "token_ids": []}, features=features)
    )
    dataset.save_to_disk(str(out_dir))
    num_contexts = len(dataset)
    return SaelensExport(
        str(out_dir), hook_name, context_size, d_in, num_contexts, store.num_tokens - num_contexts * context_size
    )


def _contexts(store: ActivationStore, module: str, context_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(activations [context_size, d_in], token ids [context_size]) of consecutive tokens, prompts back to back."""
    rows: list[torch.Tensor] = []
    ids: list[torch.Tensor] = []
    num_held = 0
    for prompt in store:
        rows.append(prompt[module])
        ids.append(prompt.token_ids)
        num_held += prompt.num_tokens
        if num_held < context_size:
            continue
        flat_rows, flat_ids = torch.cat(rows), torch.cat(ids)  # [num_held, d_in], [num_held]
        num_whole = num_held // context_size * context_size
        yield from zip(flat_rows[:num_whole].split(context_size), flat_ids[:num_whole].split(context_size))
        rows, ids, num_held = [flat_rows[num_whole:]], [flat_ids[num_whole:]], num_held - num_whole


def _chunks(items: Iterator, size: int) -> Iterator[list]:
    while chunk := list(itertools.islice(items, size)):
        yield chunk
