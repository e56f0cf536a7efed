"""What one decoder layer costs the host inside a packed step: the ATen ops it dispatches, against HF's own layer.

Every kernel a layer dispatches is a launch on an accelerator; planning that belongs to the step (masks, page
tables) must not run inside a layer. The oracle is HF's forward of the same model with its DynamicCache.
"""

from __future__ import annotations

import copy
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import nnrun
from model_zoo import make_model, random_prompts
from nnrun.attention.hf_glue import paged_attention_forward
from nnrun.attention.score_terms import HalfScores

_NO_KERNEL = {"_unsafe_view", "lift_fresh", "detach", "empty", "new_empty", "empty_strided", "alias"}
# A paged layer writes its new K and V into the pool (HF's cache concatenates them); a decode layer then
# gathers its requests' K and V, and on CPU attends in three ops (baddbmm, softmax, bmm) where sdpa is one.
PAGED_DECODE_EXTRA_KERNELS = 4


class _LayerKernels(TorchDispatchMode):
    """Kernel ops (not views or allocations) dispatched inside each decoder layer, per layer index."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.layer: int | None = None
        self.kernels: dict[int, Counter] = {}
        for index, layer in enumerate(model.model.layers):
            layer.register_forward_pre_hook(lambda *_, index=index: setattr(self, "layer", index))
            layer.register_forward_hook(lambda *_: setattr(self, "layer", None))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        returns = func._schema.returns
        aliases = bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write
        name = func.overloadpacket.__name__
        if self.layer is not None and not aliases and name not in _NO_KERNEL:
            self.kernels.setdefault(self.layer, Counter())[name] += 1
        return func(*args, **(kwargs or {}))


def _hf_layer_kernels(model: torch.nn.Module, prompt: list[int]) -> tuple[Counter, Counter]:
    """HF's own kernels of layer 0: a prefill of `prompt`, then one decode step, with its DynamicCache."""
    from transformers import DynamicCache

    counter = _LayerKernels(model)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        with counter:
            logits = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits
        prefill, counter.kernels = counter.kernels[0], {}
        with counter:
            model(logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    return prefill, counter.kernels[0]


def _nnrun_layer_kernels(model: torch.nn.Module, prompts: list[list[int]]) -> dict[str, list[dict[int, Counter]]]:
    """nnrun's kernels per layer of each step (by mode), counted on the engine thread around `run_model`."""
    steps: dict[str, list[dict[int, Counter]]] = {"extend": [], "decode": []}
    with nnrun.LLM(model, attention_backend="torch") as llm:
        counter = _LayerKernels(model)
        run_model = llm.runner.run_model

        def counted(forward_batch):
            counter.kernels = {}
            with counter:
                logits = run_model(forward_batch)
            steps[forward_batch.forward_mode.value].append(counter.kernels)
            return logits

        llm.runner.run_model = counted
        llm.generate(prompts, nnrun.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    return steps


def test_packed_layers_dispatch_hf_kernels_plus_paging_and_no_step_planning():
    model = make_model("llama")
    prompt = random_prompts([12], seed=3)[0]
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("sdpa")  # HF's own default attention, as `generate` runs it
    hf_prefill, hf_decode = _hf_layer_kernels(twin, prompt)
    steps = _nnrun_layer_kernels(model, [prompt, list(reversed(prompt))])  # equal lengths: rows fill the table
    (prefill,) = steps["extend"]
    for kernels in prefill.values():
        assert sum(kernels.values()) <= sum(hf_prefill.values())
    assert len(steps["decode"]) == 3
    for step in steps["decode"]:
        assert step[0] == step[1]  # no mask or table built inside the first layer: planning is the step's
        assert sum(step[0].values()) <= sum(hf_decode.values()) + PAGED_DECODE_EXTRA_KERNELS


def test_mixed_lengths_build_their_masks_once_per_step():
    """Rows of different lengths need a padded mask: built by the first layer that asks, read by the others."""
    steps = _nnrun_layer_kernels(make_model("llama"), random_prompts([3, 11, 6], seed=4))
    for step in steps["decode"]:
        extra = step[0] - step[1]
        assert extra and not step[1] - step[0]  # layer 0 built it, layer 1 only read it
        assert "baddbmm" not in extra and "index_select" not in extra  # the layers' own work is the same


def test_settings_only_terms_are_built_once_per_module_until_its_settings_change():
    from nnrun.attention.context import forward_context

    model = make_model("llama")
    attention = model.model.layers[0].self_attn
    terms = []

    class Recorder:
        kv_pool = None

        def forward(self, layer_idx, q, k, v, score_terms):
            terms.append(score_terms)
            return torch.zeros(q.shape[0], q.shape[1], v.shape[-1])

    q, kv = torch.zeros(1, 4, 3, 16), torch.zeros(1, 2, 3, 16)
    with forward_context(Recorder()):
        paged_attention_forward(attention, q, kv, kv, None, scaling=0.25)
        paged_attention_forward(attention, q, kv, kv, None, scaling=0.25)
        paged_attention_forward(attention, q, kv, kv, None, scaling=0.25, softcap=5.0)
        paged_attention_forward(attention, q, kv, kv, None, scaling=0.25, softcap=5.0, s_aux=torch.zeros(4))
    assert terms[0] is terms[1]
    assert terms[2] is not terms[1] and terms[2].softcap == 5.0 and terms[2].half_scores is HalfScores.EAGER
    assert terms[3].sinks is not None and terms[3] is not terms[2]  # tensors: built per call
