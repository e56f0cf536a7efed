"""Registers the engine's attention as a transformers attention implementation.

HF attention modules keep doing their own projections, norms, RoPE and output projection; only
the `attention_interface(...)` call they make lands here, so every module path, hook point and
output convention stays exactly HF's. Outside an engine step the same model object keeps working
as a plain HF model with sdpa attention, so users can still call it directly.
"""

from __future__ import annotations

import functools
import sys
from contextlib import AbstractContextManager
from typing import Callable

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from nnrun.attention.context import current_backend, current_position_ids, current_probs_plan
from nnrun.attention.masks import selected_keys
from nnrun.attention.probabilities import AttentionProbs
from nnrun.attention.score_terms import HalfScores, ScoreTerms

ATTN_IMPLEMENTATION = "nnrun_paged"
# An attention module may carry, under this key of its `__dict__`, a function `(module, position_ids) -> [N]`
# of factors for its queries: set by a pass over the model (nnrun/position_adapters.py) on modules that
# scaled their queries by positions they numbered themselves (and its relative logits, which it scaled alike).
QUERY_RESCALE = "_nnrun_query_rescale"
# Set (True) in an attention module's `__dict__` by nnrun/attention/classic/inkling.py: inside a step the module
# passes as `position_bias` its queries' logits per key distance, `[1, Hq, N, E]` (not HF's dense bias), and
# as `sinks` (Inkling 2) one sink logit per query and head, `[1, Hq, N, 1]`.
PER_QUERY_SCORE_TERMS = "_nnrun_per_query_score_terms"
# Set (True) in a model's `__dict__` by nnrun/attention/classic when its config keeps its own attention
# implementation's name but its forward runs as well with ours and no mask: `hf_masks_skipped` uses it.
MASK_FREE_UNDER_OUR_NAME = "_nnrun_mask_free_under_our_name"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, N, D]
    key: torch.Tensor,  # [1, Hkv, N, D]
    value: torch.Tensor,  # [1, Hkv, N, Dv]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, AttentionProbs | None]:
    if torch.compiler.is_compiling():  # dynamo breaks the graph here (see `_untraced_attention_forward`)
        return _untraced_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    backend = current_backend()
    if backend is None:  # the user calls the model directly (plain HF use): behave exactly as HF would
        return _plain_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        raise RuntimeError(
            f"packed attention expects [1, H, N, D] with only this step's tokens, got query {tuple(query.shape)} "
            f"and key {tuple(key.shape)}"
        )
    relative_logits = per_query_sinks = None
    if module.__dict__.get(PER_QUERY_SCORE_TERMS, False):
        relative_logits = kwargs.pop("position_bias")[0].transpose(0, 1)  # [N, Hq, E]
        per_query_sinks = kwargs.pop("sinks", None)  # [1, Hq, N, 1]
        per_query_sinks = None if per_query_sinks is None else per_query_sinks[0, :, :, 0].T  # [N, Hq]
    _refuse_unsupported_inputs(module, kwargs)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    q = query[0].transpose(0, 1)  # [N, Hq, D]
    query_rescale = module.__dict__.get(QUERY_RESCALE)  # a module that scaled q by positions of its own
    position_ids = None if query_rescale is None else current_position_ids()
    if position_ids is not None:
        factors = query_rescale(module, position_ids)[:, None, None]  # [N, 1, 1]
        q = (q * factors).to(q.dtype)  # [N, Hq, D]
        if relative_logits is not None:
            relative_logits = (relative_logits * factors).to(relative_logits.dtype)  # [N, Hq, E]
    sinks = kwargs.get("s_aux")
    picks = kwargs.get("indices")  # DSA sparse attention: [1, N, K] the keys each query's indexer picked
    alibi_slopes = kwargs.get("alibi_slopes")  # given only by nnrun's own classic-family adapters (attention/classic)
    if sinks is None and per_query_sinks is None and picks is None and alibi_slopes is None and relative_logits is None:
        terms = _settings_only_terms(module, scaling, kwargs)
    else:
        terms = _score_terms(module, query, scaling, kwargs, per_query_sinks, relative_logits)
    out = backend.forward(module.layer_idx, q, key[0].transpose(0, 1), value[0].transpose(0, 1), terms)  # [N, Hq, Dv]
    probs_plan = current_probs_plan()
    if probs_plan is None:  # nobody in the step asked: the second output is None, as sdpa's
        return out.unsqueeze(0), None  # [1, N, Hq, Dv]
    # After the backend: it has written this layer's K into the pool, and its output stays as it is.
    return out.unsqueeze(0), probs_plan.compute(backend.kv_pool, module.layer_idx, q, terms)


def _score_terms(module, query, scaling: float, kwargs: dict, per_query_sinks, relative_logits) -> ScoreTerms:
    """The call's terms, tensors among them (sinks, picks, ALiBi slopes, relative logits)."""
    sinks = kwargs.get("s_aux")
    picks = kwargs.get("indices")  # [1, N, K]
    has_sinks = sinks is not None or per_query_sinks is not None
    return ScoreTerms(
        scaling,
        sliding_window=kwargs.get("sliding_window"),
        softcap=kwargs.get("softcap"),
        sinks=per_query_sinks if sinks is None else sinks,
        chunk_size=attention_chunk_size(module),
        alibi_slopes=kwargs.get("alibi_slopes"),
        # HF runs a softcapped layer in its eager code (sdpa refuses softcaps), rounding as it goes
        half_scores=HalfScores.EAGER if kwargs.get("softcap") is not None else kwargs.get("half_scores"),
        key_indices=None if picks is None else picks[0].long(),  # [N, K]
        relative_logits=relative_logits,
        # HF runs a layer with sinks (per head, or per query: Inkling 2) in its file's eager code, as sdpa takes
        # none: in half precision the backend runs that code, for its rounding
        half_eager=module_eager(module) if has_sinks and query.dtype != torch.float32 else None,
        num_value_parts=kwargs.get("num_value_parts", 1),
    )


_SETTINGS_TERMS = "_nnrun_settings_terms"  # a module's last settings-only ScoreTerms, with the settings it was built of


def _settings_only_terms(module: torch.nn.Module, scaling: float, kwargs: dict) -> ScoreTerms:
    """The terms of a call that passes settings only (no tensors): the module's last ones when its settings repeat.

    Every layer call of every step passes the same settings, so the terms are built once per module and
    the backends see the same object each call (FlashInfer checks a layer's terms against its plan once).
    """
    softcap = kwargs.get("softcap")
    settings = (
        scaling,
        kwargs.get("sliding_window"),
        softcap,
        kwargs.get("half_scores"),
        kwargs.get("num_value_parts", 1),
    )
    cached = module.__dict__.get(_SETTINGS_TERMS)
    if cached is not None and cached[0] == settings:
        return cached[1]
    terms = ScoreTerms(
        scaling,
        sliding_window=settings[1],
        softcap=softcap,
        chunk_size=attention_chunk_size(module),
        # HF runs a softcapped layer in its eager code (sdpa refuses softcaps), rounding as it goes
        half_scores=HalfScores.EAGER if softcap is not None else settings[3],
        num_value_parts=settings[4],
    )
    module.__dict__[_SETTINGS_TERMS] = (settings, terms)
    return terms


# Under torch.compile (decoder layers compiled into the decode graphs, nnrun/compiled_layers.py) the call runs
# untraced: the backends plan in Python and call FlashInfer's kernels, which dynamo must not trace. Checked
# inside rather than registering the disabled function: a disabled call costs eager steps ~1 us per layer.
_untraced_attention_forward = torch.compiler.disable(paged_attention_forward)


_MODULE_EAGER = "_nnrun_module_eager"  # a module's eager attention bound to it, looked up on its first call


def module_eager(module: torch.nn.Module) -> Callable | None:
    """The module's own file's `eager_attention_forward` bound to it (None if its file has none), looked up once."""
    bound = module.__dict__.get(_MODULE_EAGER, _MODULE_EAGER)
    if bound is _MODULE_EAGER:
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        bound = module.__dict__[_MODULE_EAGER] = None if eager is None else functools.partial(eager, module)
    return bound


_CHUNK_SIZE = "_nnrun_attention_chunk_size"  # a module's chunk, read from its config on its first call


def attention_chunk_size(module: torch.nn.Module) -> int | None:
    """The chunk of a chunked-attention layer (Llama 4's `chunked_attention` layers), else None.

    HF applies it through the layer's mask, which a packed step does not build; the backend masks it.
    Read once per module (a config lookup costs more than the rest of this glue).
    """
    cached = module.__dict__.get(_CHUNK_SIZE, _CHUNK_SIZE)
    if cached is not _CHUNK_SIZE:
        return cached
    config = getattr(module, "config", None)  # not every attention module keeps its config
    layer_types = getattr(config, "layer_types", None)
    chunk_size = None
    # A module shared by several layers (Zamba's) has no layer_idx of its own: the probe refuses it by name.
    layer_idx = getattr(module, "layer_idx", None)
    if layer_types is not None and isinstance(layer_idx, int) and layer_types[layer_idx] == "chunked_attention":
        chunk_size = config.attention_chunk_size
    module.__dict__[_CHUNK_SIZE] = chunk_size
    return chunk_size


# Attention inputs that change the scores per query and key, which the packed backends do not apply.
_UNSUPPORTED_TENSOR_INPUTS = ("position_bias", "sinks")


def _refuse_unsupported_inputs(module: torch.nn.Module, kwargs: dict) -> None:
    if kwargs.get("position_bias") is None and kwargs.get("sinks") is None:  # two reads: this runs per layer call
        return
    given = [name for name in _UNSUPPORTED_TENSOR_INPUTS if kwargs.get(name) is not None]
    raise ValueError(
        f"{type(module).__name__} (layer {module.layer_idx}) passes {given} to its attention: per-query "
        "score terms that nnrun's packed attention does not apply, so its results would be wrong"
    )


# Attention inputs HF's sdpa cannot apply (it drops sinks and refuses softcaps): the module's own eager runs them.
_EAGER_ONLY_INPUTS = ("s_aux", "softcap")


def _plain_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs):
    """sdpa, as HF; a call with inputs sdpa cannot apply gets the module's own file's eager attention.

    A DSA layer hands its indexer's picks (`indices`) to any implementation but eager and sdpa, whose
    mask it folds them into itself: here they are folded into the mask our builder made, as HF would.
    """
    picks = kwargs.pop("indices", None)  # [B, S, K]
    if picks is not None:
        attention_mask = _with_picks(attention_mask, picks, query, key)
    eager_only = [name for name in _EAGER_ONLY_INPUTS if kwargs.get(name) is not None]
    if not eager_only:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(
            f"{type(module).__name__} attends with {eager_only}, which sdpa cannot apply, and its "
            "module has no eager attention to run them"
        )
    out, _ = eager(
        module,
        query,
        key,
        value,
        _additive_mask(attention_mask, query, key),
        dropout=dropout,
        scaling=scaling,
        **kwargs,
    )
    return out, None  # no probabilities, as sdpa returns none


def _with_picks(sdpa_mask_: torch.Tensor | None, picks: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
    """Bool `[B, 1, S, T]`: the mask our builder made (None: causal), and of those keys only each query's picks."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if sdpa_mask_ is None:
        sdpa_mask_ = torch.ones((q_len, kv_len), dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    return sdpa_mask_ & selected_keys(picks, kv_len)[:, None]


def _additive_mask(sdpa_mask_: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The eager form (0 or the dtype's min, added to the scores) of the mask our builder made for sdpa.

    None (a model that built no mask) means plain causal, bottom-right aligned.
    """
    if sdpa_mask_ is None:
        q_len, kv_len = query.shape[2], key.shape[2]
        sdpa_mask_ = torch.ones((q_len, kv_len), dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    if sdpa_mask_.dtype != torch.bool:
        return sdpa_mask_
    return torch.zeros(sdpa_mask_.shape, dtype=query.dtype, device=query.device).masked_fill(
        ~sdpa_mask_, torch.finfo(query.dtype).min
    )


def paged_attention_mask(*args, **kwargs) -> torch.Tensor | None:
    """No mask inside an engine step (the backend knows each request's span); sdpa's mask outside.

    Outside, the mask is always built: sdpa's builder would otherwise return None for a plain causal
    mask and leave causality to the module's `is_causal`, which some causal decoders leave False
    (BigBirdPegasus's), trusting the mask.
    """
    if current_backend() is not None:
        return None
    return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})


def hf_masks_skipped(model: torch.nn.Module | None = None) -> AbstractContextManager[None]:
    """Within an engine step, HF prepares no attention mask at all.

    The mask builder above is registered so that the model, called plainly, masks like sdpa. But
    a registered name makes every mask factory (`create_causal_mask`, the sliding one) run its
    preprocessing first, `find_packed_sequence_indices` included (a `.all()` that syncs a GPU),
    before reaching a builder that returns None. HF's own early exit for implementations that
    build no mask skips all of it: while a step runs, the name is taken out of the mask registry.
    A `model` whose config keeps its own implementation's name (the classic families, which
    cannot take ours: nnrun/attention/classic) bears ours for the step too when the classic pass
    marked it `MASK_FREE_UNDER_OUR_NAME`, or it would build an eager `[1, 1, N, N]` mask over the
    whole packed batch (Falcon with ALiBi: one per head) that its adapted attention never reads.
    Re-entrant; the engine runs one step at a time (a plain call from another thread during a step
    already lands in the engine's attention, by the one forward context).
    """
    return _MasksSkipped(model)


class _MasksSkipped:
    """`hf_masks_skipped`'s block; a class rather than a generator: it is entered once per step, it costs less."""

    __slots__ = ("model", "builder", "own_name")

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        self.model = model

    def __enter__(self) -> None:
        self.builder = AttentionMaskInterface._global_mapping.pop(ATTN_IMPLEMENTATION, None)
        model = self.model
        self.own_name = ATTN_IMPLEMENTATION
        if model is not None and model.__dict__.get(MASK_FREE_UNDER_OUR_NAME, False):
            config = model.config
            self.own_name = config._attn_implementation_internal
            if self.own_name != ATTN_IMPLEMENTATION:
                config._attn_implementation_internal = ATTN_IMPLEMENTATION

    def __exit__(self, *exc: object) -> None:
        if self.own_name != ATTN_IMPLEMENTATION:
            self.model.config._attn_implementation_internal = self.own_name
        if self.builder is not None:
            AttentionMaskInterface._global_mapping[ATTN_IMPLEMENTATION] = self.builder


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, paged_attention_mask)
