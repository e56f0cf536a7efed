"""`model.scan(...)`: activation shapes and dtypes without running the engine.

nnsight's scan runs the forward under a fake-tensor mode, so only metadata propagates. nnrun's
modules belong to the engine: its thread may be running them this very moment, and their attention
reads the step's KV pages. So a scan runs on a copy of the module tree on the meta device (no
weights, HF's sdpa attention), wrapped as nnsight's own HF model, and the block's references to
this model and its envoys are pointed at the copy while the block runs. Shapes are what HF gives for
the scanned input (padded `[B, T, ...]` for several prompts, as on nnsight-on-HF).
"""

from __future__ import annotations

import copy
import threading
from types import CodeType
from typing import Any

import torch

from nnsight.intervention.envoy import Envoy
from nnsight.intervention.tracer import ScanningTracer
from nnsight.tracing.util import push

_build_lock = threading.Lock()


class ScanTracer(ScanningTracer):
    """`with model.scan(prompt):` on the meta copy; names bound in the block come home as in a trace."""

    def __init__(self, model: Any, *args: Any, **kwargs: Any) -> None:
        self.model = model
        scan_model = scan_model_of(model)
        super().__init__(scan_model, scan_model._call, *args, **kwargs)

    def execute(self, code: CodeType) -> None:
        frame = self.info.frame
        stand_in = _StandInFrame(frame, self._redirect(frame.f_locals), self._redirect(frame.f_globals))
        before = dict(stand_in.f_locals)
        self.info.frame = stand_in
        try:
            super().execute(code)
        finally:
            self.info.frame = frame
        pushed = {
            name: value for name, value in stand_in.f_locals.items() if name not in before or before[name] is not value
        }
        if pushed:
            push(frame, pushed)

    def _redirect(self, namespace: dict) -> dict:
        """A copy of `namespace` where this model and its envoys are the meta copy's."""
        scan_model = self.envoy
        redirected = dict(namespace)
        for name, value in namespace.items():
            if value is self.model:
                redirected[name] = scan_model
            elif isinstance(value, Envoy) and getattr(value, "interleaver", None) is self.model.interleaver:
                redirected[name] = _same_path(scan_model, value.path)
        return redirected


class _StandInFrame:
    """What nnsight's tracer reads from the user's frame, with the redirected names."""

    def __init__(self, frame: Any, f_locals: dict, f_globals: dict) -> None:
        self.f_locals = f_locals
        self.f_globals = f_globals
        self.f_code = frame.f_code
        self.f_lineno = frame.f_lineno


def scan_model_of(model: Any) -> Any:
    """The model's meta copy as nnsight's HF model, built on first use."""
    with _build_lock:
        scan_model = model.__dict__.get("_scan_model")
        if scan_model is None:
            scan_model = _build_scan_model(model)
            object.__setattr__(model, "_scan_model", scan_model)
        return scan_model


def _build_scan_model(model: Any) -> Any:
    from nnsight.modeling.transformers import TransformersModel

    module = model._module
    config = copy.deepcopy(module.config)
    with torch.device("meta"):
        # sdpa: the engine's attention function needs a step's KV pages, which a scan has none of.
        meta_module = type(module)._from_config(config, attn_implementation="sdpa", dtype=module.dtype)
    meta_module.eval()
    # device="meta": the pipeline nnsight wraps the module in would otherwise move it to the CPU.
    return TransformersModel(
        meta_module, task="text-generation", tokenizer=model.tokenizer, rename=model._rename, device="meta"
    )


def _same_path(root: Any, path: str) -> Any:
    envoy = root
    for name in path.split(".")[1:]:  # paths start at the root's own name, "model"
        envoy = envoy[int(name)] if name.isdigit() else getattr(envoy, name)
    return envoy
