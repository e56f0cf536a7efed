"""Which path serves a model: packed when the probe finds it exact, else HF's own forward per request."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from nnrun.attention.hf_glue import QUERY_RESCALE
from nnrun.exact.hf_forward import HFForward, attention_implementation, own_attention, set_attention
from nnrun.exact.probe import (
    ModelRefusedError,
    ProbePrompt,
    dtype_refusal,
    hf_references,
    high_position_prompt,
    packed_path_difference,
    probe_lengths,
    probe_prompts,
)
from nnrun.model_probe import AttentionLayerInfo, probe_attention_layers
from nnrun.position_adapters import adapt_positions
from nnrun.state.mixers import adapted_mixer_layer_ids
from nnrun.state.placeholders import feed_forward_layer_ids, with_state_placeholders

if TYPE_CHECKING:
    from nnrun.forward_path import PackedPath
    from nnrun.model_runner import ModelRunner

logger = logging.getLogger(__name__)

FORCED_REASON = "forward_path='exact' was asked for"


def family_of(model: torch.nn.Module) -> str:
    """The model's `model_type` (its family in transformers), or its class name."""
    return getattr(model.config, "model_type", None) or type(model).__name__


def packed_layers(model: torch.nn.Module, device: torch.device) -> tuple[list[AttentionLayerInfo], str | None]:
    """The attention layers the packed path would serve, or the reason it cannot serve this model.

    Mixer layers the state pool serves (nnrun/state) need no attention: numbered between attention
    layers, they get KV-less placeholders, as do a hybrid's feed-forward-only layers (Nemotron-H's);
    a model of mixers only (Mamba) has no attention layers.
    """
    state_layer_ids = adapted_mixer_layer_ids(model)
    kv_free_layer_ids = state_layer_ids | feed_forward_layer_ids(model) if state_layer_ids else frozenset()
    try:
        layers = probe_attention_layers(model, device, kv_free_layer_ids)
    except ValueError as error:  # the probe's own refusal names the reason
        return [], str(error)
    except Exception as error:  # any other failure of the packed forward sends the model to the exact path too
        return [], f"the packed forward fails ({type(error).__name__}: {error})"
    if not layers and not state_layer_ids:
        return [], "no layer calls transformers' attention interface (its attention, if any, is the family's own code)"
    return with_state_placeholders(layers), None


def choose_exact_forward(runner: "ModelRunner", packed: "PackedPath", packed_unfit: str | None) -> HFForward | None:
    """Probe the model; return the exact path's HF forward if the `packed` path must not serve it, else None.

    Raises `ModelRefusedError` for a model whose dtypes are not those HF's own loading gives it, or
    whose own HF forward fails on a plain prompt.
    """
    model = runner.model
    family = family_of(model)
    if not getattr(model, "can_generate", lambda: True)():
        raise ModelRefusedError(
            f"{family}: {type(model).__name__} cannot generate text (HF's can_generate() is False: an encoder-only "
            "or other non-causal head); nnrun runs causal language models (AutoModelForCausalLM's classes)"
        )
    refusal = dtype_refusal(model, runner.dtype, family)
    if refusal is not None:
        raise refusal
    hf = HFForward(model, runner.device)
    prompts = _probe_prompts(runner, hf, packed_unfit)
    with attention_implementation(model, own_attention(model)):
        references = hf_references(hf, prompts, family)
    reason = packed_unfit or packed_path_difference(runner, packed, prompts, references)
    if reason is None:
        return None
    log = logger.info if reason == FORCED_REASON else logger.warning
    log(
        "%s runs on nnrun's exact path (one HF forward per request, with HF's own cache; slower than packed): %s",
        family,
        reason,
    )
    hf.caches.clear()
    hf.reason = reason
    set_attention(model, own_attention(model))  # from now on the model runs as HF runs it
    return hf


def _probe_prompts(runner: "ModelRunner", hf: HFForward, packed_unfit: str | None) -> list[ProbePrompt]:
    """Short prompts that fit the context and the KV pool, then (for the packed path, where the family's forward
    takes `position_ids`) one at positions near `min(max_model_len, 4096)`."""
    model = runner.model
    page_size, vocab_size, special_ids = (
        runner.allocator.page_size,
        model.get_input_embeddings().num_embeddings,
        _special_ids(model),
    )
    max_len = min(runner.max_model_len, runner.req_to_token_pool.max_context_len)
    lengths = probe_lengths(
        _shortest_window(runner), max_len, runner.max_total_tokens, page_size, runner.req_to_token_pool.num_free_rows
    )
    prompts = probe_prompts(vocab_size, special_ids, lengths)
    if packed_unfit is None and "position_ids" in hf.takes and not _numbers_positions_itself(model):
        high = high_position_prompt(vocab_size, special_ids, runner.max_model_len, runner.max_total_tokens, page_size)
        prompts += [high] if high is not None else []
    return prompts


def _numbers_positions_itself(model: torch.nn.Module) -> bool:
    """Whether a module numbers positions itself, and nnrun hands it the step's positions instead.

    HF's own forward would not move those positions with `position_ids` (Inkling's log scaling,
    Llama 4's temperature, roberta-style and encoder-decoder position tables), so a prompt at moved
    `position_ids` would compare unlike things.
    """
    return bool(adapt_positions(model)) or any(QUERY_RESCALE in module.__dict__ for module in model.modules())


def _special_ids(model: torch.nn.Module) -> set[int]:
    ids: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None)):
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "unk_token_id"):
            value = getattr(source, name, None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(v for v in value if isinstance(v, int))
    return ids


def _shortest_window(runner: "ModelRunner") -> int | None:
    """The shortest sliding window or attention chunk, so a probe prompt can cross it."""
    windows = [
        size for layer in runner.layers for size in (layer.sliding_window, getattr(layer, "chunk_size", None)) if size
    ]
    for config in (runner.model.config, getattr(runner.model.config, "text_config", None)):
        chunk = getattr(config, "attention_chunk_size", None) if config is not None else None
        if isinstance(chunk, int) and chunk > 0:
            windows.append(chunk)
    return min(windows, default=None)
