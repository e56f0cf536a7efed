"""Right-padded batches for training and scoring the tiny models."""

import torch


def collate(sequences: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input_ids / attention_mask / labels (-100 on padding)."""
    max_len = max(len(ids) for ids in sequences)
    input_ids = torch.full((len(sequences), max_len), pad_id)  # [batch, max_len] int64
    attention_mask = torch.zeros_like(input_ids)  # [batch, max_len] int64
    for row, ids in enumerate(sequences):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, -100)  # [batch, max_len] int64
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def last_token_logits(logits: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The logits at each row's last real token of a right-padded batch."""
    last_indices = attention_mask.sum(dim=1) - 1  # [batch] int64
    return logits[torch.arange(logits.shape[0]), last_indices]  # [batch, vocab]
