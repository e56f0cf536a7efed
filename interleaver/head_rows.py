"""HeadRows: a traced prompt's every-position logits, computed only while some block can still read them.

A trace's prompt keeps the logits of every position (`NNsightRequestHelper.wants_all_logits`), as
HF's forward returns them, for the blocks that read the LM head, the model's output or the trace's
result. Most traces read a decoder layer and never look at them, and the LM head over every
position (`[T, V]` per prompt, `V` 128k on Llama-3) is then the trace's largest cost past the
untraced prefill.

So the head's call is routed (its class swapped for a subclass of the same name whose `__call__`
asks `HeadRows`, as `nnrun.graph_pieces` routes decoder layers; its `forward`, hooks and nnsight's
controller stay as they are) and the runner arms it for a step that keeps rows nobody samples from.
The decision is taken when the forward reaches the head, not before the step: a block served at
layer 16 may next wait on `lm_head.output`. By then every block of the step is parked somewhere or
finished. If none is parked where the step's logits are read or may still be read (the head, the
model's output, `model.logits`, `model.samples`, the trace's result: anywhere but a module the
forward visits before the head) and none observes the run (`tracer.cache()`), the head runs on the
rows the engine samples only, `[1, B, H] -> [1, B, V]`, and the runner cuts the step's layout to
them (`keep_next_rows_only`). Otherwise the call is the head's own, on every row.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import torch

from nnrun.call_routing import routed_class
from nnrun.forward_batch import ForwardBatch

_ROUTER_ATTR = "_nnrun_head_rows"  # on the LM head: a weakref to its HeadRows


class HeadRows:
    """Runs the model's LM head on a step's next-token rows only, when armed and no block can read the others."""

    def __init__(
        self,
        model: torch.nn.Module,
        head: torch.nn.Module,
        head_path: str,
        may_read_logits: Callable[[Callable[[str], bool]], bool],
        is_block_call: Callable[[], bool],
    ) -> None:
        """`head_path`: the head's nnsight path (`model.lm_head`); `may_read_logits(reads_logits)`: whether a
        block of the step is parked on a location for which `reads_logits` says True (or may read them
        otherwise); `is_block_call`: whether a block runs now."""
        self.head = head
        self.may_read_logits = may_read_logits
        self.is_block_call = is_block_call
        self.head_path = head_path
        self.before_head = {  # every module but the root and the head (and what the head holds)
            f"model.{name}"
            for name, _ in model.named_modules()
            if name and not f"model.{name}.".startswith(self.head_path + ".")
        }
        self._reads_logits: dict[str, bool] = {}  # location -> whether a block parked there may read logits
        self._rows: torch.Tensor | None = None  # [B] the next-token rows among the head's R input rows (armed)
        self._num_logits = 0  # R: the rows the head receives in the armed step
        self.is_trimmed = False  # the last armed step's head ran on its next-token rows only
        _route(head, self)

    @contextmanager
    def step(self, forward_batch: ForwardBatch, device: torch.device) -> Iterator[None]:
        """Armed for `forward_batch` if it keeps rows nobody samples from and no request wants prompt logprobs."""
        self.is_trimmed = False
        num_logits = int(forward_batch.logits_indices.numel())
        if num_logits <= forward_batch.batch_size or any(r is not None for r in forward_batch.prompt_logits_rows):
            yield
            return
        self._rows = torch.tensor(forward_batch.next_token_logits_rows, dtype=torch.int64, device=device)  # [B]
        self._num_logits = num_logits
        try:
            yield
        finally:
            self._rows = None

    def reads_logits(self, location: str) -> bool:
        """Whether a block parked on `location` may read the step's logits: unless it is a module's value
        visited before the head (a location nobody knows is taken to read them)."""
        known = self._reads_logits.get(location)
        if known is None:
            known = self._reads_logits[location] = not any(
                location.startswith(prefix + ".") and prefix in self.before_head for prefix in _prefixes(location)
            )
        return known

    def call(self, head: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        own_call = super(type(head), head).__call__
        rows = self._rows
        if rows is None or self.is_block_call():
            return own_call(*args, **kwargs)  # not armed, or a block's own call (a logit lens)
        self._rows = None  # the forward calls its head once a step
        hidden = args[0] if len(args) == 1 and not kwargs else None
        if (
            not isinstance(hidden, torch.Tensor)
            or hidden.dim() != 3
            or tuple(hidden.shape[:2]) != (1, self._num_logits)
            or self.may_read_logits(self.reads_logits)
        ):
            return own_call(*args, **kwargs)
        self.is_trimmed = True
        return own_call(hidden.index_select(1, rows))  # [1, B, H] -> [1, B, V]


def keep_next_rows_only(forward_batch: ForwardBatch) -> None:
    """The step's logits layout once its head ran on the next-token rows: one row per request, in batch order."""
    forward_batch.logits_indices = forward_batch.logits_indices[forward_batch.next_token_logits_rows]  # [B]
    forward_batch.next_token_logits_rows = list(range(forward_batch.batch_size))


def parked_where_logits_are_read(mediators: Iterable[Any], reads_logits: Callable[[str], bool]) -> bool:
    """Whether one of `mediators` observes the run or is parked where `reads_logits` says True (or nowhere known)."""
    for mediator in mediators:
        if mediator.caches:
            return True
        if not mediator.alive:
            continue
        pending = mediator.pending
        if pending is None or pending.provider is None or reads_logits(pending.provider):
            return True
    return False


def _prefixes(location: str) -> Iterator[str]:
    """`model.layers.0.output` -> `model.layers.0`, `model.layers`, `model`."""
    end = location.rfind(".")
    while end > 0:
        yield location[:end]
        end = location.rfind(".", 0, end)


def _route(head: torch.nn.Module, rows: HeadRows) -> None:
    cls = type(head)
    if cls.__dict__.get("__call__") is not _routed_call:
        head.__class__ = routed_class(cls, _routed_call)
    object.__setattr__(head, _ROUTER_ATTR, weakref.ref(rows))


def _routed_call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The LM head's `__call__`: its own call, or on the sampled rows only, as its `HeadRows` says."""
    router = self.__dict__.get(_ROUTER_ATTR)
    rows = None if router is None else router()
    if rows is None:
        return super(type(self), self).__call__(*args, **kwargs)
    return rows.call(self, args, kwargs)
