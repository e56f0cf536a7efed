"""Decode CUDA graphs in pieces, one per decoder layer, for steps in which blocks watch some modules.

A whole-step graph runs no Python, so a decode step that any block reads or writes used to run
eagerly from end to end. Pieces keep the step's HF forward in Python (embeddings, rotary tables,
final norm, lm_head: everything outside the decoder layers runs as usual) and send each decoder
layer's call, as the forward reaches it, either to that layer's captured graph or to its ordinary
call. The runner's `PieceGate` decides layer by layer: a layer no block waits in replays bare; a
layer some block waits in gets its ordinary call (`LayerCall`), with its hooks and nnsight's
handoffs, so a block sees exactly the eager values. The decision is taken when the forward reaches
the layer, not once per step: a block served at layer 2 may next wait on layer 5, and layer 5 must
then run its call.

A layer watched only at its boundary (its own input or output) needs its handoffs, not its body:
the gate may run the call with the layer's forward, for that call only, replaced by the piece's
replay (`LayerCall.replay_forward`): the handoffs serve the blocks as usual, an edited input is what
the replay loads, and the output a block edits is a fresh copy the next layer receives. Whether
the forward may replay is decided inside it, after the input handoff: a block served there may
next wait inside the layer, and then the real forward runs.

Capture (per padded batch size, after the whole-step graphs, with the same capturer and so the
same memory pool): the model's own forward runs once over the whole-step graphs' static inputs,
and each decoder layer's call is captured as it comes, on static copies of its arguments (hidden
states, rotary tables, position ids). A replay copies the live arguments into those copies (the
first `B` rows of the padded batch along the one dimension where they differ), replays, and hands
back a fresh copy of the first `B` rows of the graph's outputs. Attention inside a piece reads the
page tables `DecodeGraphRunner.load_step` planned into the graph buffers; eager layers of the same
step read the step's ordinary plan.

Memory: the static arguments and outputs are one set per batch size shared by every layer (the
same shapes), so a piece costs the pool only its intermediates, which the next capture reuses.

Routing: each decoder layer's class is swapped for a subclass of the same name whose `__call__`
asks the router; the layer's `forward`, its hooks and anything installed on it (nnsight's
controller) are untouched, and outside a pieces step the call is `nn.Module.__call__` itself.
"""

from __future__ import annotations

import functools
import logging
import weakref
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from operator import is_
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from nnrun.call_routing import routed_class
from nnrun.cuda_graph import DecodeGraphRunner, GraphCapturer, SizeWatch

logger = logging.getLogger(__name__)

_ROUTER_ATTR = "_nnrun_graph_piece"  # on each decoder layer: (weakref to its DecoderLayerPieces, layer index)


class PieceGate(Protocol):
    """Who decides, as a pieces step reaches each decoder layer, whether the layer replays."""

    def runs_eagerly(self, layer_index: int) -> bool:
        """Whether the layer must run its call now (something may read or write at or inside it)."""
        ...

    def run_eagerly(self, layer_index: int, call: LayerCall) -> Any:
        """Run the layer's call (`call()`, or with its forward replayed); the gate may watch what it visits."""
        ...

    def replayed(self, layer_index: int) -> None:
        """The layer replayed instead of running its eager call."""
        ...


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's list of decoder layers: the first ModuleList as long as the text config's layer count, looked for
    in HF's text decoder (`get_decoder()`) first: a vision or audio tower may hold a list of that length too."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    num_layers = getattr(config, "num_hidden_layers", None)
    if not num_layers:
        return None
    for root in (_text_decoder(model), model):
        for module in root.modules():
            if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers:
                return module
    return None


def _text_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """HF's text decoder of `model` (`get_decoder()`), or the model itself where it names none."""
    get_decoder = getattr(model, "get_decoder", None)  # (every causal LM family's tiny model answers it)
    decoder = get_decoder() if callable(get_decoder) else None
    return decoder if isinstance(decoder, torch.nn.Module) else model


@dataclass
class _Piece:
    """One decoder layer's captured call at one batch size."""

    replay: Callable[[], None]
    skeleton: tuple  # the call's (args, kwargs) nesting (`_flatten`)
    statics: list[torch.Tensor | None]  # per argument leaf: its static copy, None for a non-tensor leaf
    constants: list[Any]  # per argument leaf: the non-tensor value it had at capture
    out_spec: TreeSpec | None  # None: the layer returns one tensor
    out_statics: list[torch.Tensor | None]  # per output leaf: the static buffer the graph writes
    out_constants: list[Any]
    plans: dict[tuple, _Plan] = field(default_factory=dict)  # per live (shape, dtype) of the leaves


@dataclass
class _Plan:
    """How a call with given leaf shapes loads into a piece: which static rows, and the outputs' rows."""

    fits: bool
    constants: list[tuple[int, Any]] = field(default_factory=list)  # (leaf index, its value at capture), non-tensors
    loads: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (leaf index, static, its rows)
    outputs: list[Any] = field(default_factory=list)  # per output leaf: the static rows, or the constant


@dataclass
class _Step:
    """A decode step running in pieces: its gate, padded size and the arguments loaded so far."""

    gate: PieceGate
    graph_size: int
    loaded: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)  # id(static) -> (live, version)
    last_call: _FlatCall | None = None  # the last layer call's flattening: the next layer's differs only in args[0]


@dataclass
class _FlatCall:
    """A layer call taken apart (`_flatten`), with its leaves' plan key, for the next layer of the step to reuse.

    Every decoder layer of a step gets the same keyword arguments (rotary tables, position ids, masks: the
    very same objects) and a new hidden state as its one positional argument; a call whose arguments past
    the first are those objects flattens like the last one with its first leaf replaced.
    """

    first: Any  # args[0]
    rest: tuple  # args[1:]
    names: tuple[str, ...]  # the keyword names, in order
    values: tuple  # the keyword values, in order
    leaves: list[Any]
    skeleton: tuple
    key: tuple  # per leaf: (shape, dtype) of a tensor, None otherwise


class LayerCall:
    """A decoder layer's call in a pieces step, which a gate runs: eagerly, or with its forward replayed."""

    __slots__ = ("layer", "_eager", "_args", "_kwargs", "_replay")

    def __init__(
        self,
        layer: torch.nn.Module,
        eager: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        replay: Callable[[tuple, dict], Any | None],
    ) -> None:
        self.layer = layer
        self._eager, self._args, self._kwargs, self._replay = eager, args, kwargs, replay

    def __call__(self) -> Any:
        """The layer's call as PyTorch makes it: hooks, handoffs and its forward."""
        return self._eager(*self._args, **self._kwargs)

    def replay_forward(self, args: tuple, kwargs: dict) -> Any | None:
        """The layer's forward alone, replayed on these (possibly edited) arguments; None where they do not fit.

        For the forward's slot inside the call: the hooks around it still run, and what it
        returns is a fresh copy, which they may edit in place or replace.
        """
        return self._replay(args, kwargs)


class DecoderLayerPieces:
    """Per-layer decode graphs for `graphs`' batch sizes, and the routing of a step's layer calls."""

    def __init__(self, layers: torch.nn.ModuleList, graphs: DecodeGraphRunner) -> None:
        self.layers = list(layers)
        self.graphs = graphs
        self.pieces: dict[int, dict[int, _Piece]] = {}  # batch size -> layer index -> piece
        self.num_replays = 0  # layer calls replayed so far (for benchmarks and tests)
        self._buffers: dict[int, dict[tuple, torch.Tensor]] = {}  # batch size -> key -> static shared by layers
        self._capturing: tuple[int, GraphCapturer] | None = None
        self._step: _Step | None = None
        self.capturer: GraphCapturer | None = None  # the lazy captures' (`takes`)
        self.watch: SizeWatch | None = None  # when each size is captured, where sizes are captured lazily
        self._route()

    # ---- routing --------------------------------------------------------------------------
    def _route(self) -> None:
        routed_classes: dict[type, type] = {}
        me = weakref.ref(self)
        for index, layer in enumerate(self.layers):
            cls = type(layer)
            if cls not in routed_classes:
                routed_classes[cls] = routed_class(cls, _routed_call)
            layer.__class__ = routed_classes[cls]
            object.__setattr__(layer, _ROUTER_ATTR, (me, index))

    def remove(self) -> None:
        """Give the layers back their own classes."""
        for layer in self.layers:
            layer.__dict__.pop(_ROUTER_ATTR, None)
            if type(layer).__dict__.get("__call__") is _routed_call:
                layer.__class__ = type(layer).__mro__[1]

    def call(self, layer: torch.nn.Module, index: int, args: tuple, kwargs: dict) -> Any:
        eager = super(type(layer), layer).__call__
        if self._capturing is not None:
            return self._capture_layer(eager, index, args, kwargs)
        step = self._step
        if step is None:
            return eager(*args, **kwargs)
        piece = self.pieces[step.graph_size].get(index)
        if not step.gate.runs_eagerly(index):
            outputs = None if piece is None else self._replay(piece, step, args, kwargs)
            if outputs is not None:
                step.gate.replayed(index)
                return outputs
        replay = _does_not_fit if piece is None else functools.partial(self._replay, piece, step)
        return step.gate.run_eagerly(index, LayerCall(layer, eager, args, kwargs, replay))

    @contextmanager
    def step(self, graph_size: int, gate: PieceGate) -> Iterator[None]:
        """Route the decoder layers' calls during one decode step `graphs.load_step` has loaded."""
        self._step = _Step(gate, graph_size)
        try:
            yield
        finally:
            self._step = None

    # ---- replay ---------------------------------------------------------------------------
    def _replay(self, piece: _Piece, step: _Step, args: tuple, kwargs: dict) -> Any | None:
        """Load the live arguments, replay and return the outputs' live rows; None if the call does not fit."""
        flat = _flatten_like(step.last_call, args, kwargs)
        step.last_call = flat
        leaves, key = flat.leaves, flat.key
        if flat.skeleton != piece.skeleton:
            return None
        plan = piece.plans.get(key)
        if plan is None:
            plan = piece.plans[key] = _plan_replay(piece, leaves, step.graph_size)
        if not plan.fits:
            return None
        for index, constant in plan.constants:
            leaf = leaves[index]
            if leaf is not constant and leaf != constant:
                return None
        loaded = step.loaded
        for index, static, rows in plan.loads:
            leaf = leaves[index]
            version = leaf._version
            previous = loaded.get(id(static))
            if previous is not None and previous[0] is leaf and previous[1] == version:
                continue  # the same tensor every layer gets (the rotary tables): loaded once a step
            rows.copy_(leaf)
            loaded[id(static)] = (leaf, version)
        piece.replay()
        self.num_replays += 1
        # Fresh copies: the next layer's replay rewrites the shared buffers.
        outputs = [value.clone() if isinstance(value, torch.Tensor) else value for value in plan.outputs]
        return outputs[0] if piece.out_spec is None else tree_unflatten(outputs, piece.out_spec)

    # ---- capture --------------------------------------------------------------------------
    def capture(self, capturer: GraphCapturer, batch_sizes: Sequence[int]) -> None:
        """Capture every decoder layer for each batch size (largest first), running the model's own forward."""
        graphs = self.graphs
        for batch_size in sorted(batch_sizes, reverse=True):
            self.pieces[batch_size] = {}
            graphs.prepare_capture(batch_size)
            self._capturing = (batch_size, capturer)
            try:
                graphs.forward_fn(batch_size)()
            finally:
                self._capturing = None
            missing = len(self.layers) - len(self.pieces[batch_size])
            if missing:
                raise RuntimeError(f"{missing} decoder layers were not called by a decode forward")
        logger.info("captured %d decoder-layer decode graphs per batch size %s", len(self.layers), list(batch_sizes))

    @property
    def refused(self) -> str | None:
        """Why a lazy capture failed (no size is captured after it); None while none has."""
        return None if self.watch is None else self.watch.refused

    def takes(self, batch_size: int, unwatched: Callable[[], AbstractContextManager] = nullcontext) -> bool:
        """Whether a watched decode step of `batch_size` rows runs in pieces; counts it towards a lazy capture.

        With lazy whole-step graphs (`DecodeGraphRunner.lazy`), a size's pieces are captured when its watched steps
        meet that rule, under `unwatched()`, by the capturer `capture_decoder_layer_pieces` was given.
        """
        graph_size = self.graphs.padded_batch_size(batch_size)
        if graph_size is None:
            return False
        return graph_size in self.pieces or self.watch.capture_when_due(
            graph_size, self._capture_size, unwatched, "watched decode steps", "decoder-layer graphs"
        )

    def _capture_size(self, batch_size: int) -> None:
        try:
            self.capture(self.capturer, [batch_size])
        except BaseException:
            self.pieces.pop(batch_size, None)  # no half-captured size
            raise

    def _capture_layer(self, eager: Callable, index: int, args: tuple, kwargs: dict) -> Any:
        batch_size, capturer = self._capturing
        if index in self.pieces[batch_size]:
            raise RuntimeError(f"decoder layer {index} is called twice in one forward")
        buffers = self._buffers.setdefault(batch_size, {})
        leaves, skeleton = _flatten(args, kwargs)
        statics = [
            _shared_static(buffers, ("in", i), leaf) if isinstance(leaf, torch.Tensor) else None
            for i, leaf in enumerate(leaves)
        ]
        constants = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]

        def layer_call() -> Any:
            values = [leaf if static is None else static for leaf, static in zip(leaves, statics)]
            call_args, call_kwargs = _unflatten(values, skeleton)
            return eager(*call_args, **call_kwargs)

        with torch.no_grad():
            out_leaves, out_spec = tree_flatten(layer_call())  # once, for the outputs' shapes
            out_statics = [
                _shared_static(buffers, ("out", i), leaf) if isinstance(leaf, torch.Tensor) else None
                for i, leaf in enumerate(out_leaves)
            ]

        def piece() -> None:
            for static, leaf in zip(out_statics, tree_flatten(layer_call())[0]):
                if static is not None:
                    static.copy_(leaf)

        replay, _ = capturer.capture(piece)
        out_constants = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in out_leaves]
        self.pieces[batch_size][index] = _Piece(
            replay, skeleton, statics, constants, None if out_spec.is_leaf() else out_spec, out_statics, out_constants
        )
        return tree_unflatten([leaf if s is None else s for leaf, s in zip(out_leaves, out_statics)], out_spec)


def _plan_replay(piece: _Piece, leaves: list[Any], graph_size: int) -> _Plan:
    """Where each live leaf goes: the whole static, or its first rows along the one dimension that differs."""
    token_dim, num_rows = None, graph_size
    plan = _Plan(fits=False)
    for index, (leaf, static, constant) in enumerate(zip(leaves, piece.statics, piece.constants)):
        if static is None:
            if isinstance(leaf, torch.Tensor):
                return plan
            plan.constants.append((index, constant))
            continue
        if not isinstance(leaf, torch.Tensor) or leaf.dtype != static.dtype or leaf.dim() != static.dim():
            return plan
        differing = [d for d, (a, b) in enumerate(zip(leaf.shape, static.shape)) if a != b]
        if len(differing) > 1 or (differing and leaf.shape[differing[0]] > static.shape[differing[0]]):
            return plan
        if differing:
            if token_dim not in (None, differing[0]) or num_rows not in (graph_size, leaf.shape[differing[0]]):
                return plan
            token_dim, num_rows = differing[0], leaf.shape[differing[0]]
            plan.loads.append((index, static, static.narrow(token_dim, 0, num_rows)))
        else:
            plan.loads.append((index, static, static))
    for static, constant in zip(piece.out_statics, piece.out_constants):
        if static is None:
            plan.outputs.append(constant)
        elif token_dim is None:
            plan.outputs.append(static)
        elif static.dim() <= token_dim or static.shape[token_dim] != graph_size:
            return plan  # cannot tell the live rows of this output apart
        else:
            plan.outputs.append(static.narrow(token_dim, 0, num_rows))
    plan.fits = True
    return plan


def _flatten(args: tuple, kwargs: dict) -> tuple[list[Any], tuple]:
    """A layer call's leaves (tuples and lists opened) and a hashable skeleton to rebuild it; cheaper than pytree.

    Called for every decoder layer of a pieces step: list comprehensions, no generators.
    """
    leaves: list[Any] = []
    add_leaf = leaves.append

    def skeleton_of(value: Any) -> Any:
        kind = type(value)
        if kind is tuple or kind is list:
            return (kind, tuple([skeleton_of(item) for item in value]))
        add_leaf(value)
        return None

    skeleton = (
        tuple([skeleton_of(arg) for arg in args]),
        tuple([(name, skeleton_of(value)) for name, value in kwargs.items()]),
    )
    return leaves, skeleton


def _flatten_like(last: _FlatCall | None, args: tuple, kwargs: dict) -> _FlatCall:
    """`_flatten` of a layer call, reusing `last` where only the first positional argument (a tensor) is new."""
    first = args[0] if args else None
    if (
        last is not None
        and type(first) is torch.Tensor
        and type(last.first) is torch.Tensor
        and len(args) == len(last.rest) + 1
        and len(kwargs) == len(last.values)
        and all(map(is_, kwargs.values(), last.values))
        and all(map(is_, args[1:], last.rest))
        and tuple(kwargs) == last.names
    ):
        leaves = last.leaves.copy()
        leaves[0] = first
        key = ((first.shape, first.dtype), *last.key[1:])
        return _FlatCall(first, last.rest, last.names, last.values, leaves, last.skeleton, key)
    leaves, skeleton = _flatten(args, kwargs)
    key = tuple([(leaf.shape, leaf.dtype) if isinstance(leaf, torch.Tensor) else None for leaf in leaves])
    return _FlatCall(first, args[1:], tuple(kwargs), tuple(kwargs.values()), leaves, skeleton, key)


def _unflatten(leaves: list[Any], skeleton: tuple) -> tuple[tuple, dict]:
    """The (args, kwargs) `_flatten` took apart, with `leaves` in its leaves' places."""
    remaining = iter(leaves)

    def build(shape: Any) -> Any:
        if shape is None:
            return next(remaining)
        kind, items = shape
        return kind(build(item) for item in items)

    args_shape, kwargs_shape = skeleton
    return tuple(build(item) for item in args_shape), {name: build(item) for name, item in kwargs_shape}


def _shared_static(buffers: dict[tuple, torch.Tensor], slot: tuple, value: torch.Tensor) -> torch.Tensor:
    """The static buffer of this argument/output slot and shape (one for every layer), holding `value`."""
    key = (*slot, tuple(value.shape), value.dtype)
    static = buffers.get(key)
    if static is None:
        static = buffers[key] = torch.empty(value.shape, dtype=value.dtype, device=value.device)
    if static is not value:
        static.copy_(value)
    return static


def _does_not_fit(args: tuple, kwargs: dict) -> None:
    """The replay of a layer that has no piece at this batch size."""
    return None


def _routed_call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A decoder layer's `__call__`: its captured piece or its own call, as its router says."""
    router = self.__dict__.get(_ROUTER_ATTR)
    pieces = None if router is None else router[0]()
    if pieces is None:
        return super(type(self), self).__call__(*args, **kwargs)
    return pieces.call(self, router[1], args, kwargs)


def capture_decoder_layer_pieces(
    model: torch.nn.Module, graphs: DecodeGraphRunner, capturer: GraphCapturer
) -> DecoderLayerPieces | None:
    """Per-layer graphs next to `graphs`, or None (and the layers as they were) where they cannot be captured."""
    layers = decoder_layers(model)
    if layers is None:
        logger.info("no decoder-layer graphs: no list of decoder layers found")
        return None
    pieces = DecoderLayerPieces(layers, graphs)
    pieces.capturer = capturer
    if graphs.lazy is not None:
        # Each size by the whole-step graphs' rule, counted on watched steps (`takes`): at the `lazy.after`-th,
        # if the fastest took under `lazy.below_s`. A replay saves a layer's Python, not its math: a model whose
        # layers are their matmuls would pay a capture (a few of its slow steps) for nothing.
        pieces.watch = SizeWatch(graphs.lazy)
        return pieces
    try:
        pieces.capture(capturer, graphs.batch_sizes)
    except Exception as error:  # a layer that cannot run in a graph: watched steps stay eager
        pieces.remove()
        logger.info("no decoder-layer graphs (%s: %s): watched decode steps run eagerly", type(error).__name__, error)
        return None
    return pieces
