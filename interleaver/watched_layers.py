"""WatchedLayers: which decoder layers of a watched decode step replay their graph, and how.

A watched decode step runs in decoder-layer pieces (`nnrun.graph_pieces`). For each layer the
forward reaches, the gate picks one of three calls:

- no block waits on any location the layer visits: the piece replays bare (no handoffs), and the
  gate adds the layer's visits to the interleaver's counts as if it had run;
- blocks wait only at the layer's boundary (its own `.input`, `.skip` gate or `.output`): the
  layer's ordinary call runs, so nnsight's controller hands its input and output over as always,
  but the body the controller runs is, for this call only, the piece's replay; the handoffs count
  their own visits, the gate adds those inside the layer;
- a block waits inside the layer (a submodule, an op of `.source`), a skip is pending, or a block
  calls the layer itself: the real call runs.

The second case decides inside the replacement body, after the input handoff, since a block
served at the layer's input may next wait inside it.
"""

from __future__ import annotations

from itertools import repeat
from operator import add
from typing import Any

from nnsight.intervention.source import STATE

from interleaver.mediator import PackedInterleaver
from nnrun.graph_pieces import LayerCall


class WatchedLayers:
    """The `PieceGate` of a watched step: a decoder layer replays unless a block waits on a location it visits.

    Which locations a layer visits (every module's input, skip gate and output in it, or a module
    outside it that it calls) is learned from its first eager run in a traced step, as the change it
    made to the interleaver's visit counts; until then the layer runs eagerly. A replayed layer adds
    that change itself, so a block's later reads count their visits as on HF (`tracer.iter[n]`). A
    call made by a running block (a module called ad hoc) is always eager and counts nothing.
    """

    def __init__(self, interleaver: PackedInterleaver) -> None:
        self.interleaver = interleaver
        self.visits: dict[int, dict[str, int]] = {}  # layer index -> location -> visits in one call
        self.inner_visits: dict[int, dict[str, int]] = {}  # the same without the layer's own three handoffs
        self._handoffs_counted = False  # a replay inside the layer's call: its handoffs counted their visits

    def runs_eagerly(self, layer_index: int) -> bool:
        visits = self.visits.get(layer_index)
        if visits is None or self._is_unusual():
            return True
        interleaver = self.interleaver
        return not visits.keys().isdisjoint(interleaver.parked) or not visits.keys().isdisjoint(interleaver.observers)

    def _is_unusual(self) -> bool:
        """A block's own call of a layer, or a `.source` or skip a block asked for in the middle of the step."""
        interleaver = self.interleaver
        return (
            interleaver.running_blocks.innermost() is not None
            or bool(interleaver.sourced)
            or bool(interleaver.batcher.pending_skips)
        )

    def _waits_inside(self, layer_index: int) -> bool:
        """Whether a block waits on (or a cache observes) a location inside the layer, its boundary aside."""
        inner, interleaver = self.inner_visits[layer_index].keys(), self.interleaver
        return not inner.isdisjoint(interleaver.parked) or not inner.isdisjoint(interleaver.observers)

    def run_eagerly(self, layer_index: int, call: LayerCall) -> Any:
        interleaver = self.interleaver
        if layer_index not in self.visits:
            return self._learn(layer_index, call) if interleaver.busy and not self._is_unusual() else call()
        if layer_index not in self.inner_visits or self._is_unusual() or self._waits_inside(layer_index):
            return call()
        return self._replay_inside_handoffs(layer_index, call)

    def _learn(self, layer_index: int, call: LayerCall) -> Any:
        """Run the layer's first call in a traced step and keep which locations it visited."""
        counts = self.interleaver.counts
        before = dict(counts)
        output = call()
        visits = {location: count - before.get(location, 0) for location, count in counts.items()}
        self.visits[layer_index] = visits = {location: n for location, n in visits.items() if n}
        own = self._handoff_locations(call.layer)
        if own is not None:
            self.inner_visits[layer_index] = {location: n for location, n in visits.items() if location not in own}
        return output

    def _handoff_locations(self, layer: Any) -> tuple[str, str, str] | None:
        """The layer's own `.input`, `.skip` and `.output` locations in this interleaver's tree, or None."""
        state = layer.__dict__.get(STATE)
        for interleaver_ref, _, locations in () if state is None else state.routes:
            if interleaver_ref() is self.interleaver:
                return locations
        return None

    def _replay_inside_handoffs(self, layer_index: int, call: LayerCall) -> Any:
        """The layer's call with its handoffs, the piece's replay as its body (unless a block waits inside by then)."""
        state = call.layer.__dict__[STATE]
        body = state.body  # what the controller runs between the input and output handoffs

        def replaying_body(module: Any, *args: Any, **kwargs: Any) -> Any:
            if self._is_unusual() or self._waits_inside(layer_index):
                return body(module, *args, **kwargs)
            outputs = call.replay_forward(args, kwargs)
            if outputs is None:
                return body(module, *args, **kwargs)
            self._handoffs_counted = True
            try:
                self.replayed(layer_index)
            finally:
                self._handoffs_counted = False
            return outputs

        state.body = replaying_body
        try:
            return call()
        finally:
            if state.body is replaying_body:  # (a block that drilled into the layer's `.source` replaced it)
                state.body = body

    def replayed(self, layer_index: int) -> None:
        counts = self.interleaver.counts
        visits = (self.inner_visits if self._handoffs_counted else self.visits)[layer_index]
        # Every location the layer visits, counted up at once (a decoder layer visits some forty: C loops, not Python's)
        counts.update(zip(visits, map(add, map(counts.get, visits, repeat(0)), visits.values())))
