"""StatePool: each request's recurrent state (conv and SSM / linear-attention states) beside the paged KV pool.

A state is not per token, so it cannot be paged: a request owns one fixed-size state per mixer
layer, whatever its length. The pool has one row per row of the request table (`ReqToTokenPool`,
`max_num_seqs + 1` rows), and a request's state lives in the row of its table row
(`req.req_pool_idx`). So the state is allocated, freed and dropped exactly with its KV: the
scheduler's `hold_kv` gives the row, `release_kv` (finish, abort, preemption, a failed step)
takes it back, and nothing here can leak.

A row's state is only ever read for the request that wrote it: each row records how many tokens
its state has seen, and a step that continues a request from `prefix` tokens must find exactly
that many (a fresh prefill, `prefix == 0`, starts from HF's zero state and reads nothing). A row
handed to a new request therefore never leaks the old request's state into it.
"""

from __future__ import annotations

import torch

# (layer_idx, "conv" | "recurrent", state_idx): one HF cache tensor of one mixer layer
StateKey = tuple[int, str, int]


class StatePool:
    """Per mixer layer, per request-table row: the HF cache states, allocated on first write."""

    def __init__(self, num_rows: int, device: torch.device, mixer_layer_ids: list[int]) -> None:
        self.num_rows = num_rows
        self.device = device
        self.mixer_layer_ids = mixer_layer_ids  # the layers whose states it keeps
        self.tensors: dict[StateKey, torch.Tensor] = {}  # each [num_rows, *HF's per-request state shape]
        self.num_tokens = [0] * num_rows  # tokens each row's state has seen (-1: unusable, see `invalidate`)

    def read(self, key: StateKey, rows: torch.Tensor) -> torch.Tensor | None:
        """A copy of these rows' state `[len(rows), ...]`, or None if no request has written it yet."""
        tensor = self.tensors.get(key)
        return None if tensor is None else tensor.index_select(0, rows)

    def write(self, key: StateKey, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Store `values` `[len(rows), ...]` in these rows; the pool keeps values, never autograd history."""
        tensor = self.tensors.get(key)
        if tensor is None:  # HF's own shape and dtype for this state, learned from its first value
            tensor = torch.zeros((self.num_rows, *values.shape[1:]), dtype=values.dtype, device=self.device)
            self.tensors[key] = tensor
        tensor.index_copy_(0, rows, values.detach().to(tensor.dtype))

    def check_holds(self, row: int, num_tokens: int, request_id: str) -> None:
        """Raise unless row `row` holds the state of exactly `num_tokens` tokens (never serve another's state)."""
        if self.num_tokens[row] != num_tokens:
            raise RuntimeError(
                f"request {request_id} continues from {num_tokens} tokens, but its recurrent state (row {row}) "
                f"holds {self.num_tokens[row]}: a state model cannot resume from a state it does not have"
            )

    def invalidate(self, row: int) -> None:
        """This row's state is no longer any request's: only a fresh prefill may use it again."""
        self.num_tokens[row] = -1

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
