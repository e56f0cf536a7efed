"""Decoder layers compiled with torch.compile inside the captured decode graphs (an engine option, off by default).

An eager decode step launches some 47 kernels per Llama layer: HF's unfused RMSNorm, rotary
embedding, SiLU-and-multiply, casts and residual adds around the GEMMs. Inside a CUDA graph the
launches are cheap, but each kernel still reads and writes its tensor; inductor fuses the
elementwise ones. `CompiledLayersCapturer` wraps the runner's capturer: while it warms up and
captures, each decoder layer's `forward` is the compiled one, and afterwards the layers get
their own forwards back. So only the captured graphs (whole-step decode graphs and the
per-layer pieces of `graph_pieces.py`) hold the fused kernels; every step that runs eagerly
(prefill, traced steps, hooks, nnsight) runs HF's modules untouched, and a module boundary
that someone watches is never inside a compiled region.

One compiled function serves every layer and batch size: it is compiled from the layer class's
forward with dynamic shapes, and with dynamo's default of inlining `nn.Module`s their weights are
graph inputs, not constants, so the layers share one set of guards. The attention call is not
traced (`nnrun.attention.hf_glue` disables dynamo there): the backends plan in Python.

Only the families in `CHECKED_FAMILIES` compile (tests/test_compiled_layers_families.py checks each: its
replayed graphs equal the uncompiled engine's bitwise, and hooks fire in its eager steps); any other family,
and any whose compilation fails at capture, is captured with HF's forwards, with a warning saying why.
"""

from __future__ import annotations

import logging
import types
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from nnrun.config import DeviceConfig
from nnrun.cuda_graph import GraphCapturer
from nnrun.graph_pieces import decoder_layers

logger = logging.getLogger(__name__)

_NO_FORWARD = object()

# HF `model_type`s whose compiled layers were checked against the uncompiled engine (tests/test_compiled_layers_families.py)
CHECKED_FAMILIES = frozenset(
    {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma2",
        "gemma3_text",
        "phi3",
        "olmo2",
        "gpt_neox",
        "gpt2",
        "mixtral",
        "qwen2_moe",
    }
)


class CompiledLayersCapturer:
    """A `GraphCapturer` whose captures run the decoder layers' compiled forwards; eager calls stay HF's."""

    backend: str | Callable = "inductor"  # torch.compile's backend (the CPU tests, recording aten ops, use aot_eager)

    def __init__(
        self,
        inner: GraphCapturer,
        layers: torch.nn.ModuleList,
        backend: str | Callable | None = None,
        own_forward: OwnForward | None = None,
        family: str = "model",
    ) -> None:
        self.inner = inner
        self.captures_attention = getattr(inner, "captures_attention", True)
        self.layers = list(layers)
        self.own_forward = own_forward or plain_own_forward
        self.family = family  # named in the warning of a failed compilation
        if backend is not None:
            self.backend = backend
        self._compiled: dict[Callable, Callable] = {}  # per forward function: its compiled form
        self.failure: str | None = None  # why compiling failed: every capture from then on runs HF's forwards

    def capture(self, fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        if self.failure is None:
            try:
                with self.compiled_forwards():
                    return self.inner.capture(fn)
            except torch._dynamo.exc.TorchDynamoException as error:  # compilation runs in the warm-up, before capture
                cause = getattr(error, "inner_exception", None) or error  # the backend's own error
                self.failure = f"{type(cause).__name__}: {(str(cause).splitlines() or [''])[0]}"
                logger.warning(
                    "compile_decoder_layers: the %s decoder layers run uncompiled in the decode graphs: "
                    "torch.compile failed (%s)",
                    self.family,
                    self.failure,
                )
        return self.inner.capture(fn)

    @contextmanager
    def compiled_forwards(self) -> Iterator[None]:
        """Within: each layer's `forward` is its own forward compiled, with no interpreter wrapper inside; after, as was.

        Wrappers that `own_forward` sees through (nnsight's controllers, the instance `forward` it installs
        on every module it wraps: the runner's seam) are set aside in the layers and their modules: a graph
        runs no Python, so they would do nothing in it, and each holds its own module's state, on which
        dynamo would guard, compiling once per layer.
        """
        saved = [
            (module, module.__dict__.get("forward", _NO_FORWARD)) for layer in self.layers for module in layer.modules()
        ]
        try:
            for layer in self.layers:
                for module in layer.modules():
                    forward = self.own_forward(module)
                    if module is layer and forward is None:  # a wrapper of its own: compiled as it is
                        module.__dict__["forward"] = self._compiled_forward(module.__dict__["forward"])
                    elif module is layer:
                        module.__dict__["forward"] = types.MethodType(self._compiled_forward(forward), module)
                    elif forward is type(module).forward:
                        module.__dict__.pop("forward", None)
                    elif forward is not None:
                        module.__dict__["forward"] = types.MethodType(forward, module)
            yield
        finally:
            for module, forward in saved:
                if forward is _NO_FORWARD:
                    module.__dict__.pop("forward", None)
                else:
                    module.__dict__["forward"] = forward

    def _compiled_forward(self, forward: Callable) -> Callable:
        compiled = self._compiled.get(forward)
        if compiled is None:
            compiled = self._compiled[forward] = torch.compile(forward, backend=self.backend, dynamic=True)
        return compiled


OwnForward = Callable[[torch.nn.Module], "Callable | None"]


def plain_own_forward(module: torch.nn.Module) -> Callable | None:
    """The module's forward as an unbound function; None: leave its instance forward (a wrapper nnrun does not know)."""
    forward = module.__dict__.get("forward")
    if forward is None:
        return type(module).forward
    if isinstance(forward, types.MethodType) and forward.__self__ is module:
        return forward.__func__
    return None


def with_compiled_layers(
    capturer: GraphCapturer, model: torch.nn.Module, device: DeviceConfig, own_forward: OwnForward | None = None
) -> GraphCapturer:
    """`capturer`, or it wrapped to compile the decoder layers where `device.compile_decoder_layers` asks;
    `own_forward`: a module's own forward under the wrappers the runner installs (`plain_own_forward`)."""
    if not device.compile_decoder_layers:
        return capturer
    family = model.config.model_type
    if family not in CHECKED_FAMILIES:
        logger.warning(
            "compile_decoder_layers: the %s decoder layers run uncompiled in the decode graphs: compiling them is "
            "checked against HF's values for %s only",
            family,
            ", ".join(sorted(CHECKED_FAMILIES)),
        )
        return capturer
    layers = decoder_layers(model)
    if layers is None:
        logger.warning("compile_decoder_layers: the %s decoder layers run uncompiled: no list of them found", family)
        return capturer
    logger.info("decode graphs capture %d %s decoder layers compiled with torch.compile", len(layers), family)
    return CompiledLayersCapturer(capturer, layers, own_forward=own_forward, family=family)
