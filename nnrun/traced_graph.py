"""Decode graphs on CPU: a step's aten ops replayed by TorchScript's interpreter, attention too where it can be.

On CPU a small decode step's time is mostly Python: HF's module calls and torch's dispatch of each op
from Python (3-6 µs an op, a few hundred ops a step). A CUDA graph removes that cost on a GPU; a CPU
has none. `TracedCapturer` records every aten op of one decode forward, as a CUDA graph records
kernels, and hands each run of ops between two attention calls to `torch.jit.trace`, whose
interpreter runs the same ATen kernels in the same order from C++ (about 1 µs an op; its
optimisation passes off, so no op is fused or reordered and values are the eager step's, bitwise).

Attention calls (`backend.forward`) change shape every step (the KV grows) and are planned by the
backend in Python. A call the backend can give as plain ops (`AttentionBackend.decode_ops`: the torch
backend's decode of small heads, its views written with -1 where the KV length goes) joins the run
around it, traced with the step's slots and masks as extra inputs fetched at each replay: a Llama's
whole decode step is then one traced call. Any other call runs eagerly between the pieces, as vLLM's
piecewise graphs leave attention out.

A replay keeps a CUDA graph's semantics: tensors the recorded code read but did not make (weights,
the graph runner's step buffers, the KV pool) are read as they are at replay; tensors the code made
in Python at capture (not through an op) stay frozen; reading a tensor on the host during capture
(`.item()`, `nonzero`) refuses the capture, as it would fail a CUDA graph's. The runner decodes
eagerly where a capture is refused (`cuda_graph.DecodeGraphRunner`).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from nnrun.attention import AttentionBackend
from nnrun.attention.base import DecodeOps
from nnrun.cuda_graph import CaptureRefused

# Ops that read a tensor on the host, or whose output's size depends on its data: a value a replay would freeze
HOST_SYNC_OPS = frozenset(
    {
        torch.ops.aten._local_scalar_dense.default,  # .item(), bool(t), int(t), float(t)
        torch.ops.aten.item.default,  # the same, in inference mode
        torch.ops.aten.nonzero.default,
        torch.ops.aten.masked_select.default,
        torch.ops.aten.equal.default,
        torch.ops.aten.unique_consecutive.default,
        torch.ops.aten._unique2.default,
    }
)


# A batch size's graph is captured at its 4th decode step nothing watched (short runs never pay for one), if its
# fastest such step took under 2 ms per decoder layer. A capture costs about four eager steps (a warm-up, the
# recording, the tracing, a first replay); a replay saves the step's Python, about 0.2 ms per layer (some 90 ops
# each ~2.5 µs cheaper), not its math: under 2 ms a layer that is 10% or more of a step, repaid within ~40 steps.
# Above it (a 30M Llama at batch 16: 3-4 ms a layer) replays are no faster and the capture is lost time.
CPU_CAPTURE_AFTER = 4
CPU_CAPTURE_BELOW_S_PER_LAYER = 2e-3


# Tensor methods that read values on the host without an op a dispatch mode would see (a CPU tensor's memory)
HOST_READS = frozenset({"tolist", "numpy", "item", "__bool__", "__int__", "__float__", "__index__", "__complex__"})


@dataclass(frozen=True)
class _Slot:
    """Where a tensor lives in a replay's environment (a list, one entry per tensor the forward touched)."""

    index: int


@dataclass
class _Op:
    func: Any  # an OpOverload
    args: tuple
    kwargs: dict
    output: Any


@dataclass
class _AttentionCall:
    layer_idx: int
    q: torch.Tensor  # [N, Hq, D]
    k: torch.Tensor  # [N, Hkv, D]
    v: torch.Tensor  # [N, Hkv, Dv]
    terms: Any  # ScoreTerms, its tensor fields mapped like the other arguments
    output: torch.Tensor  # [N, Hq, Dv]
    ops: DecodeOps | None = None  # the call as ops the trace takes in (`AttentionBackend.decode_ops`), or None


class _Recorder(TorchDispatchMode):
    """Runs every op, and keeps it with the tensors it read and made; `paused` while an attention call runs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[_Op | _AttentionCall] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        if any(cls is not torch.Tensor and not issubclass(torch.Tensor, cls) for cls in types):
            raise CaptureRefused(f"{func} runs on a tensor subclass ({types}), whose Python a replay would skip")
        if func in HOST_SYNC_OPS:
            raise CaptureRefused(f"{func} reads a tensor on the host, whose value a replay would freeze")
        output = func(*args, **kwargs)
        if args and output is args[0] and not func._schema.is_mutable:
            return output  # returned its input untouched (`to` its own dtype): a replay would too, as shapes are fixed
        self.calls.append(_Op(func, args, kwargs, output))
        return output


class _HostReads(TorchFunctionMode):
    """Refuses the host reads that reach no op on CPU (`tolist`, `numpy`, a tensor as a Python number)."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.recorder.paused and getattr(func, "__name__", None) in HOST_READS:
            raise CaptureRefused(
                f"Tensor.{func.__name__} reads a tensor on the host, whose value a replay would freeze"
            )
        return func(*args, **(kwargs or {}))


def _tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]


def _term_tensors(terms: Any) -> dict[str, torch.Tensor]:
    """A ScoreTerms' tensor fields by name (per-query terms the forward computed, or settings it holds)."""
    if not dataclasses.is_dataclass(terms):
        return {}
    fields = ((field.name, getattr(terms, field.name)) for field in dataclasses.fields(terms))
    return {name: value for name, value in fields if isinstance(value, torch.Tensor)}


class _Slots:
    """Numbers every tensor the recording touched, by identity; the first numbers are the inputs it read."""

    def __init__(self) -> None:
        self.index: dict[int, int] = {}
        self.captured: list[torch.Tensor] = []  # by slot, the tensor of the recording (examples for the tracer)
        self.inputs: list[torch.Tensor | None] = []  # by slot, the tensor a replay reads (None: one it makes)

    def read(self, tensor: torch.Tensor) -> _Slot:
        if id(tensor) not in self.index:
            # A parameter is read through a detached alias: the same memory, no autograd in the replay
            self._add(tensor, tensor.detach() if tensor.requires_grad else tensor)
        return _Slot(self.index[id(tensor)])

    def make(self, tensor: torch.Tensor) -> _Slot:
        if id(tensor) not in self.index:  # an in-place op's output is its input: that keeps its slot
            self._add(tensor, None)
        return _Slot(self.index[id(tensor)])

    def _add(self, tensor: torch.Tensor, replayed: torch.Tensor | None) -> None:
        self.index[id(tensor)] = len(self.captured)
        self.captured.append(tensor)
        self.inputs.append(replayed)

    def template(self, value: Any) -> Any:
        return tree_map(lambda leaf: self.read(leaf) if isinstance(leaf, torch.Tensor) else leaf, value)


def _fill(template: Any, env: dict[int, torch.Tensor] | list) -> Any:
    return tree_map(lambda leaf: env[leaf.index] if isinstance(leaf, _Slot) else leaf, template)


@dataclass
class _Piece:
    """A run of ops between two attention calls the backend runs itself, traced: reads `reads` slots, writes
    `writes` slots. Calls it gave as ops (`folded`) are in the trace, which reads their step inputs last; a step
    that one of them does not fit (`DecodeOps.fits`) runs the run op by op, those calls the backend's own."""

    run: Callable[..., tuple]
    reads: list[int]
    writes: list[int]
    folded: list[DecodeOps]
    eager_attention: Callable[..., tuple]

    def __call__(self, env: list) -> None:
        tensors = [env[slot] for slot in self.reads]
        if not self.folded:
            outputs = self.run(*tensors)
        elif all(ops.fits() for ops in self.folded):
            outputs = self.run(*tensors, *[tensor for ops in self.folded for tensor in ops.inputs()])
        else:
            outputs = self.eager_attention(*tensors)
        for slot, value in zip(self.writes, outputs):
            env[slot] = value


@dataclass
class _EagerAttention:
    """One attention call, run by the backend at replay on that step's plan."""

    forward: Callable[..., torch.Tensor]
    layer_idx: int
    q: int
    k: int
    v: int
    terms: Any
    term_slots: dict[str, int]
    output: int

    def __call__(self, env: list) -> None:
        terms = self.terms
        if self.term_slots:
            terms = dataclasses.replace(terms, **{name: env[slot] for name, slot in self.term_slots.items()})
        env[self.output] = self.forward(self.layer_idx, env[self.q], env[self.k], env[self.v], terms)


class _Program:
    """A recorded forward as traced pieces and eager attention calls over one environment of slots."""

    def __init__(self, calls: list[_Op | _AttentionCall], output: torch.Tensor | None, forward: Callable) -> None:
        slots = _Slots()
        # Each call with its tensors as slots; slots of tensors read before any call made them are inputs
        steps: list[tuple] = []
        for call in calls:
            if isinstance(call, _AttentionCall):
                reads = [slots.read(tensor).index for tensor in (call.q, call.k, call.v)]
                term_slots = {name: slots.read(tensor).index for name, tensor in _term_tensors(call.terms).items()}
                # A call the backend gave as ops joins the traced run around it; any other splits the runs
                kind = "folded" if call.ops is not None and not term_slots else "attention"
                steps.append((kind, call, reads, term_slots, slots.make(call.output).index))
            else:
                args, kwargs = slots.template(call.args), slots.template(call.kwargs)
                made = [slots.make(tensor).index for tensor in _tensors(call.output)]
                steps.append(("op", call.func, args, kwargs, made))
        self.output = None if output is None else slots.read(output).index
        self.initial = slots.inputs  # [slot] -> the tensor a replay starts from (None: made during the replay)
        self.steps: list[_Piece | _EagerAttention] = []
        # Split at attention calls; a piece returns what later steps (or the forward's result) read
        runs: list[list[tuple]] = [[]]
        for step in steps:
            if step[0] == "attention":
                runs.append([step])
                runs.append([])
            else:
                runs[-1].append(step)
        later_reads = self._later_reads(runs)
        for position, run in enumerate(runs):
            if run and run[0][0] == "attention":
                _, call, (q, k, v), term_slots, made = run[0]
                self.steps.append(_EagerAttention(forward, call.layer_idx, q, k, v, call.terms, term_slots, made))
            elif run:
                self.steps.append(self._trace(run, later_reads[position], slots.captured, forward))

    def _later_reads(self, runs: list[list[tuple]]) -> list[set[int]]:
        """For each run, the slots some later run (or the result) reads."""
        later: list[set[int]] = []
        seen = set() if self.output is None else {self.output}
        for run in reversed(runs):
            later.append(set(seen))
            for step in run:
                if step[0] != "op":
                    seen.update(step[2])
                    seen.update(step[3].values())
                else:
                    seen.update(leaf.index for leaf in tree_flatten((step[2], step[3]))[0] if isinstance(leaf, _Slot))
        return list(reversed(later))

    def _trace(self, run: list[tuple], read_later: set[int], captured: list[torch.Tensor], forward: Callable) -> _Piece:
        reads: list[int] = []
        made: set[int] = set()
        writes: list[int] = []
        changed: list[int] = []  # read tensors an op changes in place (a static output buffer's `copy_`)
        folded: list[DecodeOps] = []  # the run's attention calls as ops, in order (each adds its step's inputs)
        for kind, what, args, kwargs, outputs in run:
            if kind == "folded":
                folded.append(what.ops)
                slots_read, outputs = args, [outputs]
            else:
                slots_read = [leaf.index for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, _Slot)]
            for index in slots_read:
                if index not in made and index not in reads:
                    reads.append(index)
            for slot in outputs:
                if slot in reads:  # an in-place op on a read tensor changes it where it is
                    changed.append(slot)
                elif slot not in made:
                    made.add(slot)
                    if slot in read_later:
                        writes.append(slot)
        # The traced function returns what later steps read; a run whose only effect is in place returns the
        # tensors it changed, which the tracer needs as outputs (the piece stores nothing of them)
        returned = writes or list(dict.fromkeys(changed))
        capture_inputs = [ops.inputs() for ops in folded]  # each folded call's step inputs now (examples for the trace)
        num_inputs = [len(inputs) for inputs in capture_inputs]

        def run_ops(*tensors: torch.Tensor, eager_attention: bool = False) -> tuple:
            """The run's ops on the read tensors, then (past them) each folded call's step inputs in order; with
            `eager_attention`, the folded calls are the backend's ordinary calls instead (no step inputs)."""
            env = dict(zip(reads, tensors))
            step_inputs = iter(tensors[len(reads) :])
            folded_calls = iter(num_inputs)
            for kind, what, args, kwargs, outputs in run:
                if kind == "op":
                    result = what(*_fill(args, env), **_fill(kwargs, env))
                    for slot, value in zip(outputs, _tensors(result)):
                        env[slot] = value
                    continue
                q, k, v = (env[slot] for slot in args)
                if eager_attention:
                    env[outputs] = forward(what.layer_idx, q, k, v, what.terms)
                else:
                    env[outputs] = what.ops.run(q, k, v, *[next(step_inputs) for _ in range(next(folded_calls))])
            return tuple(env[slot] for slot in returned)

        if not reads or not returned:  # nothing to hand the tracer (a run of factories, or of nothing read later)
            return _Piece(run_ops, reads, writes, folded, functools.partial(run_ops, eager_attention=True))
        example = [captured[slot].detach() for slot in reads] + [t for inputs in capture_inputs for t in inputs]
        traced = _traced(run_ops, example)
        return _Piece(traced, reads, writes, folded, functools.partial(run_ops, eager_attention=True))

    def replay(self, out: torch.Tensor | None) -> None:
        env = list(self.initial)
        with torch.jit.optimized_execution(False):  # no pass fuses or reorders the eager step's kernels
            for step in self.steps:
                step(env)
        if out is not None:
            out.copy_(env[self.output])


def _traced(run_ops: Callable[..., tuple], example: list[torch.Tensor]) -> Callable[..., tuple]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript is in maintenance; its tracer warns on every use
        with torch.jit.optimized_execution(False):
            return torch.jit.trace(run_ops, tuple(example), check_trace=False, strict=False)


class TracedCapturer:
    """`GraphCapturer` for CPU: records a forward's ops, traces them between eager calls of `backend.forward`."""

    captures_attention = False  # the backend's calls run eagerly at replay, planned by the backend per step

    def __init__(self, backend: AttentionBackend, max_rows: int = 1, folds_attention: bool = True) -> None:
        """`max_rows`: the most rows a captured output has (the largest batch): the outputs of all captures with the
        same trailing shape share one buffer of that many rows (graphs replay one at a time, and a replay's output
        is read before the next), where one each would hold `sizes x vocabulary` logits per size.

        `folds_attention`: trace the attention calls the backend can give as ops (`AttentionBackend.decode_ops`)
        with the ops around them, so that a step replays as one traced call where every layer's is one; off
        where graphs pad their batches (a padded step's attention is the backend's own call, made eagerly).
        """
        self.backend = backend
        self.max_rows = max_rows
        self.folds_attention = folds_attention
        self._outputs: dict[tuple, torch.Tensor] = {}  # (trailing shape, dtype) -> the buffer outputs are rows of

    def capture(self, fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        with torch.inference_mode():
            fn()  # the warm-up a CUDA capture runs first: lazy initialisations stay out of the recording
        recorder = _Recorder()
        backend = self.backend
        forward = backend.forward

        def attention_call(layer_idx, q, k, v, terms):
            recorder.paused = True  # the backend's own ops run at replay as they do now: not recorded
            try:
                output = forward(layer_idx, q, k, v, terms)
                ops = backend.decode_ops(layer_idx, q, k, v, terms) if self.folds_attention else None
            finally:
                recorder.paused = False
            recorder.calls.append(_AttentionCall(layer_idx, q, k, v, terms, output, ops))
            return output

        patched = backend.__dict__.get("forward")
        backend.forward = attention_call
        try:
            with recorder, _HostReads(recorder), torch.inference_mode():
                output = fn()
        finally:
            if patched is None:
                del backend.forward  # the class's method again
            else:
                backend.forward = patched
        if output is not None and not isinstance(output, torch.Tensor):
            raise CaptureRefused(f"a traced capture returns one tensor or None, got {type(output).__name__}")
        with torch.inference_mode():
            program = _Program(recorder.calls, output, forward)
        recorder.calls = []  # the recording's tensors: only the program's inputs stay
        static = None if output is None else self._output_rows(output)

        def replay() -> None:
            with torch.inference_mode():  # as an eager step nothing watches (`ModelRunner.grad_context`)
                program.replay(static)

        replay()  # the first replay, with the tracer's first runs, in the capture's time
        return replay, static

    def _output_rows(self, output: torch.Tensor) -> torch.Tensor:
        """Where replays write `output`: the first rows of the shared buffer for its trailing shape, an ordinary
        tensor (not an inference one), which callers may read as any other."""
        if output.dim() == 0:
            return torch.empty_like(output)
        key = (tuple(output.shape[1:]), output.dtype, output.device)
        buffer = self._outputs.get(key)
        if buffer is None or buffer.shape[0] < output.shape[0]:
            rows = max(self.max_rows, output.shape[0])
            buffer = self._outputs[key] = output.new_empty((rows, *output.shape[1:]))
        return buffer[: output.shape[0]]
