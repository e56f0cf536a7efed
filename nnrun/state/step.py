"""StateStep: one packed forward's use of the state pool, and how a mixer layer runs in it.

Inside a packed forward the mixer gets the flat `[1, N, H]` input of every request in the step. It
runs HF's own mixer code on each request's tokens with that request's state, never across a
request boundary:

- requests that bring one token after a cached prefix (decodes) run together, as one `[B, 1, H]`
  batch over their gathered states (HF's single-token update path);
- a fresh prefill runs alone as `[1, T, H]` from HF's empty state (HF's whole-sequence path);
- more than one token after a cached prefix (no scheduler does that today) runs token by token,
  each a decode, because HF's whole-sequence scans start from a zero state.

New states are held until the forward ends and are written to the pool only if it ended normally
with every mixer layer run: a forward that raised (and may be run again without some requests)
leaves every request's state as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from nnrun.forward_batch import ForwardBatch
from nnrun.state.hf_cache import rows_cache, written_states
from nnrun.state.pool import StateKey, StatePool

# (hidden [B, T, H], HF cache, kwargs) -> HF's per-token outputs, each [B, T, ...]
MixerCall = Callable[[torch.Tensor, Any, dict[str, Any]], tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class Segment:
    """One request's tokens in the step: flat `[start, start + num_new)`, after `prefix` cached tokens."""

    row: int  # its request-table row: its state's row in the pool
    start: int
    num_new: int
    prefix: int


@dataclass
class StateStep:
    """The step's segments, and the states its mixer layers computed, until the forward ends."""

    pool: StatePool
    segments: list[Segment]
    num_mixer_layers: int
    pending: list[tuple[StateKey, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (key, rows, values)
    reached: dict[int, set[int]] = field(default_factory=dict)  # row -> the mixer layers that ran on it
    modules_run: set[int] = field(default_factory=set)  # id() of each mixer module the model's forward ran

    def __post_init__(self) -> None:
        # The decodes' layout, the same for every mixer layer: built once per step, on the device once.
        self.decodes = [s for s in self.segments if s.prefix and s.num_new == 1]
        self.decode_starts = torch.tensor([s.start for s in self.decodes], device=self.pool.device)  # [B]
        self.decode_rows = torch.tensor([s.row for s in self.decodes], device=self.pool.device)  # [B]

    def is_first_call(self, module: object) -> bool:
        """Whether this is the model's own call of `module` in the step (a later one is someone else's)."""
        if id(module) in self.modules_run:
            return False
        self.modules_run.add(id(module))
        return True

    @classmethod
    def for_batch(cls, pool: StatePool, forward_batch: ForwardBatch, num_mixer_layers: int) -> "StateStep":
        segments = []
        for req, start, num_new, prefix in zip(
            forward_batch.reqs, forward_batch.extend_start_loc, forward_batch.extend_seq_lens, forward_batch.prefix_lens
        ):
            if prefix:
                pool.check_holds(req.req_pool_idx, prefix, req.request_id)
            segments.append(Segment(req.req_pool_idx, start, num_new, prefix))
        return cls(pool, segments, num_mixer_layers)

    @property
    def num_tokens(self) -> int:
        return sum(segment.num_new for segment in self.segments)

    # ---- a mixer layer --------------------------------------------------------------------
    def run_mixer(
        self, layer_idx: int, num_states: int, hidden_states: torch.Tensor, kwargs: dict[str, Any], call: MixerCall
    ) -> tuple[torch.Tensor, ...]:
        """The mixer's per-token outputs over the step, each `[1, N, ...]`, each request run on its own state."""
        if hidden_states.shape[:2] != (1, self.num_tokens):
            raise RuntimeError(
                f"mixer layer {layer_idx} got input {tuple(hidden_states.shape)}, not the step's [1, {self.num_tokens}, H]"
            )
        if len(self.decodes) == len(self.segments):  # a decode step: one batched call, already in batch order
            outputs = self._run_decodes(layer_idx, num_states, hidden_states, kwargs, call)
            return tuple(output.transpose(0, 1) for output in outputs)
        pieces: dict[int, tuple[torch.Tensor, ...]] = {}  # start -> each output's [T, ...]
        if self.decodes:
            outputs = self._run_decodes(layer_idx, num_states, hidden_states, kwargs, call)  # each [B, 1, ...]
            pieces.update((s.start, tuple(output[i] for output in outputs)) for i, s in enumerate(self.decodes))
        for segment in self.segments:
            if segment.prefix and segment.num_new == 1:
                continue
            pieces[segment.start] = self._run_alone(layer_idx, num_states, hidden_states, kwargs, call, segment)
        in_order = [pieces[start] for start in sorted(pieces)]
        return tuple(_joined(parts)[None] for parts in zip(*in_order))  # each [1, N, ...]

    def _run_decodes(self, layer_idx, num_states, hidden_states, kwargs, call) -> tuple[torch.Tensor, ...]:
        starts, rows = self.decode_starts, self.decode_rows
        cache, layer = rows_cache(self.pool, layer_idx, num_states, rows, continues=True)
        batch_kwargs = {name: _token_rows(value, self.num_tokens, starts) for name, value in kwargs.items()}
        outputs = call(hidden_states[0].index_select(0, starts)[:, None], cache, batch_kwargs)  # each [B, 1, ...]
        self._hold(layer_idx, rows, written_states(layer_idx, cache, layer))
        return outputs

    def _run_alone(
        self, layer_idx, num_states, hidden_states, kwargs, call, segment: Segment
    ) -> tuple[torch.Tensor, ...]:
        rows = torch.tensor([segment.row], device=self.pool.device)  # [1]
        cache, layer = rows_cache(self.pool, layer_idx, num_states, rows, continues=segment.prefix > 0)
        if segment.prefix == 0:  # HF's whole-sequence path, from its empty state
            spans = [(segment.start, segment.num_new)]
        else:  # HF's scans cannot start from a state: one token at a time, each HF's update path
            spans = [(segment.start + i, 1) for i in range(segment.num_new)]
        outputs = []
        for start, length in spans:
            span_kwargs = {name: _token_span(value, self.num_tokens, start, length) for name, value in kwargs.items()}
            span_outputs = call(hidden_states[:, start : start + length], cache, span_kwargs)
            outputs.append(tuple(output[0] for output in span_outputs))  # each [T, ...]
        self._hold(layer_idx, rows, written_states(layer_idx, cache, layer))
        return outputs[0] if len(outputs) == 1 else tuple(_joined(parts) for parts in zip(*outputs))

    def _hold(self, layer_idx: int, rows: torch.Tensor, states: list[tuple[StateKey, torch.Tensor]]) -> None:
        self.pending.extend((key, rows, values) for key, values in states)
        for row in rows.tolist():
            self.reached.setdefault(row, set()).add(layer_idx)

    # ---- the end of the forward -----------------------------------------------------------
    def commit(self) -> None:
        """Write the step's new states; a row some mixer layer did not reach (a forward cut short) becomes unusable."""
        for key, rows, values in self.pending:
            self.pool.write(key, rows, values)
        for segment in self.segments:
            if len(self.reached.get(segment.row, ())) == self.num_mixer_layers:
                self.pool.num_tokens[segment.row] = segment.prefix + segment.num_new
            else:
                self.pool.invalidate(segment.row)


def _joined(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Outputs `[T_i, ...]` joined on tokens, `[N, ...]`, in the first one's memory layout (HF's).

    HF's short convolutions (Inkling 2's) return a transposed view, `[T, C]` with C strided: a reduction over
    C that follows (a norm) sums in another order than over a contiguous copy, and in half precision that
    moves a rounding. Joined in HF's layout, the step's outputs reduce as HF's do.
    """
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    order = sorted(range(first.dim()), key=lambda dim: first.stride(dim), reverse=True)  # outermost first (stable)
    joined = torch.cat([part.permute(order) for part in parts], dim=order.index(0))
    return joined.permute([order.index(dim) for dim in range(first.dim())])


def _token_span(value: Any, num_tokens: int, start: int, length: int) -> Any:
    """A mixer keyword argument cut to one span of the step's tokens, if it is laid out per token."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (1, num_tokens):
        return value[:, start : start + length]
    if isinstance(value, tuple):
        return tuple(_token_span(v, num_tokens, start, length) for v in value)
    return value


def _token_rows(value: Any, num_tokens: int, starts: torch.Tensor) -> Any:
    """A per-token keyword argument laid out as the decode batch `[B, 1, ...]`."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (1, num_tokens):
        return value[0].index_select(0, starts.to(value.device))[:, None]
    if isinstance(value, tuple):
        return tuple(_token_rows(v, num_tokens, starts) for v in value)
    return value
