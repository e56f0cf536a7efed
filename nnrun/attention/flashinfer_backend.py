"""FlashInfer paged attention: planned once per step on the host, one kernel call per layer.

flashinfer is imported inside the constructor, so importing this module never needs it; the CPU
tests inject a torch emulator of the two wrappers under the name `flashinfer`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from nnrun.attention.base import AttentionBackend
from nnrun.attention.flashinfer_plan import (
    PagedKVPlan,
    PlanGroup,
    flashinfer_unplanned_features,
    group_layers,
    layer_to_group_index,
    pad_decode_plan,
    plan_forward_batch,
)
from nnrun.attention.score_terms import ScoreTerms
from nnrun.forward_batch import ForwardBatch, ForwardMode
from nnrun.memory import KVPool
from nnrun.model_probe import AttentionLayerInfo

DEFAULT_WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace, shared by every wrapper
KERNEL_DTYPES = (torch.float16, torch.bfloat16)  # what FlashInfer's attention kernels are built for
MIN_GQA_GROUP_FOR_TENSOR_CORES = 4  # decode: tensor cores pay off for large GQA groups (sglang's rule)


@dataclass
class _StepMetadata:
    out_cache_loc: torch.Tensor  # [N] int64 on the device
    forward_mode: ForwardMode
    wrappers: list  # per plan group, the wrapper planned for this step


class FlashInferAttnBackend(AttentionBackend):
    """Paged attention through FlashInfer's batch prefill and decode wrappers.

    Layers are split into plan groups (same heads, window, softcap, scale, chunk); each group owns a
    prefill wrapper (extend and mixed steps) and a decode wrapper (all-decode steps), and all
    wrappers share one float workspace. `init_forward_metadata` plans the step's wrapper of every
    group once; `forward` writes the layer's new K/V into the pool and runs its group's wrapper.

    ALiBi layers are planned in FlashInfer's ALIBI mode, which adds its own built-in slopes; the
    backend serves only layers whose slopes are those (`flashinfer_unplanned_features`).
    """

    name = "flashinfer"

    def __init__(
        self,
        kv_pool: KVPool,
        device: torch.device,
        layers: list[AttentionLayerInfo],
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    ) -> None:
        import flashinfer

        super().__init__(kv_pool, device)
        self.dtype = kv_pool.k_pages[0].dtype
        if self.device.type == "cuda" and self.dtype not in KERNEL_DTYPES:
            raise ValueError(
                f"the flashinfer attention backend runs float16 or bfloat16 models, got {self.dtype}; "
                "use attention_backend='torch' for this dtype"
            )
        if workspace_bytes <= 0:
            raise ValueError(f"workspace_bytes must be positive, got {workspace_bytes}")
        unplanned = flashinfer_unplanned_features(layers, kv_pool.page_size)
        if unplanned:
            raise ValueError(f"the flashinfer attention backend cannot serve this model: {unplanned}")
        self.sink_layers = {layer.layer_idx for layer in layers if layer.has_sinks}
        self.alibi_layers = {layer.layer_idx for layer in layers if layer.has_alibi}
        self.groups: list[PlanGroup] = group_layers(layers)
        self.layer_to_group = layer_to_group_index(self.groups, len(layers))
        self._checked_terms: list[ScoreTerms | None] = [None] * len(layers)  # per layer, the terms last checked
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)  # [bytes]
        self.prefill_wrappers = [
            _plan_staged_on_return(flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD"))
            for _ in self.groups
        ]
        self.decode_wrappers = [
            _plan_staged_on_return(
                flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace,
                    kv_layout="NHD",
                    use_tensor_cores=_decode_uses_tensor_cores(group),
                )
            )
            if group.has_decode_kernel
            else None
            for group in self.groups
        ]
        self.graph_decode_wrappers: dict[int, list] = {}  # per captured batch size, one wrapper per group
        self.metadata: _StepMetadata | None = None

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        # One set of page tables per chunk size among the groups (None: whole-prefix attention).
        plans = {
            chunk_size: plan_forward_batch(forward_batch, self.kv_pool.page_size, chunk_size)
            for chunk_size in dict.fromkeys(group.chunk_size for group in self.groups)
        }
        mode = next(iter(plans.values())).forward_mode
        out_cache_loc = forward_batch.out_cache_loc.to(self.device)  # [N]
        if forward_batch.batch_size == 0:
            self.metadata = _StepMetadata(out_cache_loc, mode, [])
            return
        # flashinfer reads qo_indptr, kv_indptr and last_page_len on the host during plan() (a
        # device copy would cost one sync per group), and copies them to the device itself; the
        # page list, the one array that grows with context, goes to the device once for all groups.
        kv_indices = {
            chunk_size: plan.kv_indices.to(self.device, non_blocking=True)  # [num_pages_used] int32
            for chunk_size, plan in plans.items()
        }
        wrappers = [
            self._plan_group(index, group, plans[group.chunk_size], kv_indices[group.chunk_size])
            for index, group in enumerate(self.groups)
        ]
        self.metadata = _StepMetadata(out_cache_loc, mode, wrappers)

    def _plan_group(self, index: int, group: PlanGroup, plan: PagedKVPlan, kv_indices: torch.Tensor):
        if plan.forward_mode is ForwardMode.DECODE and group.has_decode_kernel:
            return self._plan_decode(self.decode_wrappers[index], group, plan, kv_indices)
        wrapper = self.prefill_wrappers[index]
        wrapper.plan(
            plan.qo_indptr,
            plan.kv_indptr,
            kv_indices,
            plan.kv_last_page_len,
            group.num_qo_heads,
            group.num_kv_heads,
            group.head_dim,
            plan.page_size,
            head_dim_vo=group.v_head_dim,
            causal=True,  # bottom-right aligned: new token j sees the prefix and new tokens 0..j
            **self._kernel_settings(group),
        )
        return wrapper

    def _plan_decode(self, wrapper, group: PlanGroup, plan: PagedKVPlan, kv_indices: torch.Tensor):
        wrapper.plan(
            plan.kv_indptr,
            kv_indices,
            plan.kv_last_page_len,
            group.num_qo_heads,
            group.num_kv_heads,
            group.head_dim,
            plan.page_size,
            **self._kernel_settings(group),
        )
        return wrapper

    def _kernel_settings(self, group: PlanGroup) -> dict:
        """The group's kernel variant, the same for both wrapper kinds."""
        return dict(
            pos_encoding_mode=group.pos_encoding_mode,  # NONE: HF has applied RoPE already; or ALIBI
            window_left=group.window_left,
            logits_soft_cap=group.logits_soft_cap,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            sm_scale=group.sm_scale,
        )

    # ---- CUDA graphs ------------------------------------------------------------------------
    @property
    def supports_cuda_graphs(self) -> bool:
        # Graph wrappers share one set of page-table buffers, which chunked groups cannot share.
        return all(group.has_decode_kernel and group.chunk_size is None for group in self.groups)

    def init_cuda_graph_state(self, batch_sizes: Sequence[int]) -> None:
        """One graph-mode decode wrapper per (batch size, group), all reading one set of page tables.

        A graph-mode wrapper's batch size is frozen and its `plan()` copies the tables into the
        buffers it was built with. Graphs replay one at a time, so every wrapper can share the same
        buffers (sliced to its size); the page list holds every page plus one trash page per row.
        """
        import flashinfer

        max_batch_size = max(batch_sizes)
        self.graph_kv_indptr = torch.zeros(max_batch_size + 1, dtype=torch.int32, device=self.device)
        self.graph_kv_indices = torch.zeros(
            self.kv_pool.num_pages + max_batch_size, dtype=torch.int32, device=self.device
        )
        self.graph_kv_last_page_len = torch.ones(max_batch_size, dtype=torch.int32, device=self.device)
        self.graph_decode_wrappers = {
            batch_size: [
                _plan_staged_on_return(
                    flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                        self.workspace,
                        kv_layout="NHD",
                        use_cuda_graph=True,
                        use_tensor_cores=_decode_uses_tensor_cores(group),
                        paged_kv_indptr_buffer=self.graph_kv_indptr[: batch_size + 1],
                        paged_kv_indices_buffer=self.graph_kv_indices,
                        paged_kv_last_page_len_buffer=self.graph_kv_last_page_len[:batch_size],
                    )
                )
                for group in self.groups
            ]
            for batch_size in batch_sizes
        }

    def init_forward_metadata_capture(self, batch_size: int, out_cache_loc: torch.Tensor) -> None:
        no_requests = PagedKVPlan(
            ForwardMode.DECODE, self.kv_pool.page_size, *(torch.zeros(n, dtype=torch.int32) for n in (1, 1, 0, 0))
        )
        self._plan_graph(batch_size, pad_decode_plan(no_requests, batch_size, self.kv_pool.trash_page), out_cache_loc)

    def init_forward_metadata_replay(
        self, batch_size: int, forward_batch: ForwardBatch, out_cache_loc: torch.Tensor
    ) -> None:
        plan = plan_forward_batch(forward_batch, self.kv_pool.page_size)
        self._plan_graph(batch_size, pad_decode_plan(plan, batch_size, self.kv_pool.trash_page), out_cache_loc)

    def _plan_graph(self, batch_size: int, plan: PagedKVPlan, out_cache_loc: torch.Tensor) -> None:
        kv_indices = plan.kv_indices.to(self.device, non_blocking=True)  # [pages used + padding rows] int32
        wrappers = [
            self._plan_decode(wrapper, group, plan, kv_indices)
            for wrapper, group in zip(self.graph_decode_wrappers[batch_size], self.groups)
        ]
        self.metadata = _StepMetadata(out_cache_loc, ForwardMode.DECODE, wrappers)

    def forward(self, layer_idx, q, k, v, terms: ScoreTerms):
        if self._checked_terms[layer_idx] is not terms:  # a layer's terms repeat every step (hf_glue keeps them)
            self._check_layer_terms(layer_idx, terms)
            self._checked_terms[layer_idx] = terms
        meta = self.metadata
        self.kv_pool.write(layer_idx, meta.out_cache_loc, k, v)
        if not meta.wrappers:
            return q.new_empty((0, q.shape[1], v.shape[-1]))  # [0, Hq, Dv]
        kv_cache = (self.kv_pool.k_pages[layer_idx], self.kv_pool.v_pages[layer_idx])  # NHD [pages, page_size, Hkv, D]
        wrapper = meta.wrappers[self.layer_to_group[layer_idx]]
        sinks = terms.sinks
        if sinks is None:
            return wrapper.run(q.to(self.dtype).contiguous(), kv_cache).to(q.dtype)  # [N, Hq, Dv]
        out, lse = wrapper.run(q.to(self.dtype).contiguous(), kv_cache, return_lse=True)  # [N, Hq, Dv], [N, Hq]
        return _with_sinks(out, lse, sinks).to(q.dtype)

    def _check_layer_terms(self, layer_idx: int, terms: ScoreTerms) -> None:
        """What the layer passes must be what the load-time probe planned; checked once per layer and terms object."""
        sinks, alibi_slopes = terms.sinks, terms.alibi_slopes
        if terms.key_indices is not None:  # `flashinfer_unplanned_features` keeps such models off this backend
            raise RuntimeError(f"layer {layer_idx} attends to its indexer's picks, which FlashInfer's plans cannot")
        if terms.relative_logits is not None:  # as are these
            raise RuntimeError(f"layer {layer_idx} adds relative logits per query, which FlashInfer's kernels cannot")
        if (alibi_slopes is not None) != (layer_idx in self.alibi_layers):
            raise RuntimeError(
                f"layer {layer_idx} attends {'with' if alibi_slopes is not None else 'without'} ALiBi "
                "slopes, unlike at the load-time probe"
            )
        self._check_layer_call(layer_idx, self.groups[self.layer_to_group[layer_idx]], terms)
        if (sinks is not None) != (layer_idx in self.sink_layers):
            raise RuntimeError(
                f"layer {layer_idx} attends {'with' if sinks is not None else 'without'} attention "
                "sinks, unlike at the load-time probe"
            )

    @staticmethod
    def _check_layer_call(layer_idx: int, group: PlanGroup, terms: ScoreTerms) -> None:
        """The plan was built from the load-time probe; a layer that changes its settings would be wrong."""
        planned = (
            group.sm_scale,
            group.window_left + 1 if group.window_left >= 0 else None,
            group.logits_soft_cap,
            group.chunk_size,
        )
        called = (float(terms.scaling), terms.sliding_window, terms.softcap, terms.chunk_size)
        if called != planned:
            raise RuntimeError(
                f"layer {layer_idx} attends with scaling={terms.scaling}, sliding_window={terms.sliding_window}, "
                f"softcap={terms.softcap}, chunk_size={terms.chunk_size}, but the load-time probe planned {planned}"
            )


def _with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with each head's sink logit in the softmax, from attention without it and its log-sum-exp.

    With Z the sum of exp(logits) and s the sink, the sink's softmax scales every probability by
    Z / (Z + exp(s)) = sigmoid(ln Z - s); FlashInfer's lse is ln Z in base 2 (log2 Z).
    `out` [N, Hq, Dv], `lse` [N, Hq] float32, `sinks` [Hq]; float32 [N, Hq, Dv].
    """
    scale = torch.sigmoid(lse * math.log(2) - sinks.float())  # [N, Hq]
    return out.float() * scale[:, :, None]


def _plan_staged_on_return(wrapper):
    """`wrapper`, its `plan()` safe to call again before the GPU has run the steps planned so far.

    FlashInfer's `plan()` writes the kernel's schedule into a pinned host buffer of the wrapper's and
    queues its copy to the device: a second `plan()` of the same wrapper before the GPU reached that
    copy (the next step of a multi-step window, planned while the last one runs) would overwrite the
    schedule the earlier step then reads. From pageable memory the copy is staged before `plan()`
    returns, and the buffer is free again (vLLM and mini-sglang met the same race the same way).
    """
    pinned = getattr(wrapper, "_pin_memory_int_workspace_buffer", None)
    if not isinstance(pinned, torch.Tensor):
        raise RuntimeError(
            f"{type(wrapper).__name__} has no host plan buffer `_pin_memory_int_workspace_buffer`: this FlashInfer "
            "version plans differently; check that planning ahead of the GPU cannot overwrite a queued plan"
        )
    wrapper._pin_memory_int_workspace_buffer = torch.empty(pinned.shape, dtype=pinned.dtype)  # pageable
    return wrapper


def _decode_uses_tensor_cores(group: PlanGroup) -> bool:
    return group.num_qo_heads // group.num_kv_heads >= MIN_GQA_GROUP_FOR_TENSOR_CORES
