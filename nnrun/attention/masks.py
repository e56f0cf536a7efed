"""Which keys a query may see (causal, a sliding window, attention chunks) and ALiBi's bias on them, per request."""

from __future__ import annotations

import torch


def allowed_keys(
    q_pos: torch.Tensor, kv_pos: torch.Tensor, sliding_window: int | None, chunk_size: int | None
) -> torch.Tensor:
    """Bool, broadcast of `q_pos` against `kv_pos` (positions within one request).

    HF's rules: a key at or before the query; within a window W, the last W positions
    (`kv > q - W`); with chunked attention (Llama 4), only keys of the query's own chunk
    (`kv // chunk == q // chunk`, which with causality is `kv >= q - q % chunk`).
    """
    allowed = kv_pos <= q_pos
    if sliding_window is not None:
        allowed &= kv_pos > q_pos - sliding_window
    if chunk_size is not None:
        allowed &= kv_pos >= q_pos - q_pos % chunk_size
    return allowed


def alibi_bias(slopes: torch.Tensor, num_kv_heads: int, distance: torch.Tensor) -> torch.Tensor:
    """Float32 `slope_h * (key_pos - query_pos)`, heads grouped as [Hkv, R]: `distance` is [..., n, L].

    The result broadcasts against [..., Hkv, R, n, L] when `distance` has singleton head dims in front.
    """
    grouped = slopes.float().view(num_kv_heads, -1, 1, 1)  # [Hkv, R, 1, 1]
    return grouped * distance


def selected_keys(key_indices: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Bool `[..., kv_len]`: the keys a sparse-attention indexer picked, from `[..., K]` positions (-1: none).

    DSA attention (DeepSeek-V3.2) lets each query see only its picks, and of those only the ones the
    causal mask allows: `allowed_keys(...) & selected_keys(...)`, as HF folds the two into one mask.
    """
    columns = torch.where(key_indices < 0, kv_len, key_indices.long())  # a pick of no key lands past the end
    hits = torch.zeros((*key_indices.shape[:-1], kv_len + 1), dtype=torch.bool, device=key_indices.device)
    return hits.scatter_(-1, columns, True)[..., :kv_len]


def relative_position_bias(relative_logits: torch.Tensor, num_kv_heads: int, distance: torch.Tensor) -> torch.Tensor:
    """Float32 bias from each query's own logits per backward distance (Inkling's relative position bias).

    `relative_logits` is `[..., Hq, n, E]`: query q's logit for a key `d = query_pos - key_pos` positions
    back, for `0 <= d < E`; `distance` (`query_pos - key_pos`, int64 `[..., n, L]`) broadcasts against it.
    Keys at other distances get 0, as HF's `*RelativeLogits` gives them. Returns `[..., Hkv, R, n, L]`.
    """
    extent = relative_logits.shape[-1]
    index = distance.clamp(0, extent - 1).expand(*relative_logits.shape[:-1], distance.shape[-1])  # [..., Hq, n, L]
    bias = relative_logits.float().gather(-1, index).masked_fill((distance < 0) | (distance >= extent), 0.0)
    return bias.unflatten(-3, (num_kv_heads, -1))  # [..., Hkv, R, n, L]
