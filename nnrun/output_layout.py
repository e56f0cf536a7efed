"""Which logits rows a model returns for a packed step, decided once at load.

The runner asks for the rows it samples from (`logits_to_keep=logits_indices`). Most causal LMs
return exactly those; a few ignore the argument and return every position's row (Whisper's
decoder), and then the runner takes the rows itself.
"""

from __future__ import annotations

import torch


def returns_every_position(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether `model` ignores `logits_to_keep`: a plain forward of 2 tokens asked for 1 row returns 2."""
    pad_id = getattr(model.config, "pad_token_id", None)
    token_id = 1 if pad_id == 0 else 0
    input_ids = torch.full((1, 2), token_id, dtype=torch.int64, device=device)  # [1, 2]
    with torch.no_grad():
        logits = model(input_ids=input_ids, use_cache=False, logits_to_keep=1).logits  # [1, 1 or 2, V]
    return logits.shape[1] != 1
