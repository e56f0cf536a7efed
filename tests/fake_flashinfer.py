"""A torch emulator of flashinfer 0.7.2's paged prefill and decode wrappers, for CPU tests.

Same constructor, `plan` and `run` signatures as `flashinfer.BatchPrefillWithPagedKVCacheWrapper`
and `flashinfer.BatchDecodeWithPagedKVCacheWrapper`, implementing their documented semantics from
the planned arrays only: CSR page tables (`kv_indptr`, `kv_indices`, `kv_last_page_len`, KV length
`(num_pages - 1) * page_size + last_page_len`), NHD or HND pages, bottom-right aligned causal
masking, inclusive `window_left`, `logits_soft_cap * tanh(x / logits_soft_cap)` on scaled logits
and `sm_scale` (default `head_dim ** -0.5`). It checks what the real library would reject
(index dtypes and lengths, q and KV shapes and dtypes, run before plan, a run-time window that
differs from the planned one) and records every plan and run in `module.calls`. `run(...,
return_lse=True)` also returns each row's log-sum-exp in base 2, as FlashInfer does.

`make_fake_flashinfer()` returns a fresh module object; inject it with
`monkeypatch.setitem(sys.modules, "flashinfer", module)`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from fake_cuda_graph import launch_kernel

PosTensor = Optional[torch.Tensor]
KVCache = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Call:
    """One recorded call: `kind` is "init", "plan" or "run"; `args`/`kwargs` exactly as passed."""

    kind: str
    wrapper: Any
    info: dict = field(default_factory=dict)  # "plan": the parsed plan; "num_tokens" for a run
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


def _recorded(method):
    """Append a Call to the wrapper's log once the method has returned (so failed calls are not logged)."""
    kind = "init" if method.__name__ == "__init__" else method.__name__

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        self.calls.append(Call(kind, self, dict(self._info), args, kwargs))
        return result

    return wrapper


def get_seq_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """flashinfer.get_seq_lens: KV length of each request from its CSR page table."""
    return torch.clamp(kv_indptr[1:] - kv_indptr[:-1] - 1, min=0) * page_size + kv_last_page_len


def _canonical_dtype(dtype: Union[str, torch.dtype, None]) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, dtype)


def _check_index(name: str, tensor: torch.Tensor, length: Optional[int] = None) -> torch.Tensor:
    if tensor.dtype != torch.int32 or tensor.dim() != 1:
        raise ValueError(f"{name} must be a 1-D int32 tensor, got {tensor.dtype} {tuple(tensor.shape)}")
    if length is not None and tensor.numel() != length:
        raise ValueError(f"{name} must have {length} entries, got {tensor.numel()}")
    return tensor.cpu().long()


def _split_kv_cache(paged_kv_cache: KVCache, kv_layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Both layouts as NHD `[num_pages, page_size, Hkv, D]`."""
    if isinstance(paged_kv_cache, torch.Tensor):
        k_cache, v_cache = paged_kv_cache.unbind(1)  # [pages, 2, ...]
    else:
        k_cache, v_cache = paged_kv_cache
    if kv_layout == "HND":
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    return k_cache, v_cache


@dataclass
class _Plan:
    qo_indptr: torch.Tensor  # [B+1] int64 (CPU)
    kv_indptr: torch.Tensor  # [B+1]
    kv_indices: torch.Tensor  # [>= kv_indptr[-1]]
    kv_last_page_len: torch.Tensor  # [B]
    num_qo_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_vo: int
    page_size: int
    causal: bool
    sm_scale: float
    window_left: int
    logits_soft_cap: float
    q_data_type: torch.dtype
    kv_data_type: torch.dtype
    o_data_type: torch.dtype
    alibi_slopes: Optional[torch.Tensor] = None  # [Hq] float32, in pos_encoding_mode="ALIBI"


def _make_plan(
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_last_page_len,
    num_qo_heads,
    num_kv_heads,
    head_dim_qk,
    head_dim_vo,
    page_size,
    causal,
    pos_encoding_mode,
    sm_scale,
    window_left,
    logits_soft_cap,
    q_data_type,
    kv_data_type,
    o_data_type,
) -> _Plan:
    batch_size = kv_last_page_len.numel()
    qo = _check_index("qo_indptr", qo_indptr, batch_size + 1)
    kv = _check_index("paged_kv_indptr", kv_indptr, batch_size + 1)
    indices = _check_index("paged_kv_indices", kv_indices)
    last = _check_index("paged_kv_last_page_len", kv_last_page_len, batch_size)
    if int(qo[0]) != 0 or int(kv[0]) != 0 or bool((qo[1:] < qo[:-1]).any()) or bool((kv[1:] < kv[:-1]).any()):
        raise ValueError(f"indptr arrays must start at 0 and be non-decreasing: {qo.tolist()} {kv.tolist()}")
    if int(kv[-1]) > indices.numel():
        raise ValueError(f"paged_kv_indptr[-1]={int(kv[-1])} exceeds the {indices.numel()} page indices")
    if bool(((last < 1) | (last > page_size)).any()) or bool((kv[1:] == kv[:-1]).any()):
        raise ValueError(f"every request needs >= 1 page and last_page_len in 1..{page_size}: {last.tolist()}")
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"num_qo_heads={num_qo_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if pos_encoding_mode not in ("NONE", "ALIBI"):
        raise NotImplementedError(
            f"the emulator implements pos_encoding_mode NONE and ALIBI, got {pos_encoding_mode!r}"
        )
    q_dtype = _canonical_dtype(q_data_type)
    kv_dtype = _canonical_dtype(kv_data_type) or q_dtype
    return _Plan(
        qo,
        kv,
        indices,
        last,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        head_dim_vo or head_dim_qk,
        page_size,
        causal,
        head_dim_qk**-0.5 if sm_scale is None else sm_scale,
        window_left,
        logits_soft_cap or 0.0,
        q_dtype,
        kv_dtype,
        _canonical_dtype(o_data_type) or q_dtype,
        _alibi_slopes(num_qo_heads) if pos_encoding_mode == "ALIBI" else None,
    )


def _alibi_slopes(num_heads: int) -> torch.Tensor:
    """FlashInfer's built-in ALiBi slopes (`flashinfer.utils.get_alibi_slopes`): the caller cannot give its own."""
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = torch.pow(2.0 ** (-8.0 / closest), torch.arange(1, 1 + closest))
    if closest < num_heads:
        extra = torch.pow(2.0 ** (-4.0 / closest), torch.arange(1, 1 + 2 * (num_heads - closest), 2))
        slopes = torch.cat([slopes, extra])
    return slopes.float()  # [Hq]


def _attend(
    plan: _Plan, q: torch.Tensor, paged_kv_cache: KVCache, kv_layout: str, window_left: Optional[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented semantics, one request at a time in float32.

    ALIBI mode adds `slope_h * (kv_idx - q_idx)` to the scaled logits, before the softcap (the
    default variant's `logits * sm_scale + alibi`).

    Returns the output and the log-sum-exp of each row's (scaled, capped, masked) logits, `[N, Hq]`
    float32 in base 2 (FlashInfer's default `lse`: `log2(sum_j exp(logit_j))`).
    """
    if window_left is not None and window_left != plan.window_left:
        raise AssertionError("run-time window_left must equal the planned one (non-trtllm backends)")
    k_cache, v_cache = _split_kv_cache(paged_kv_cache, kv_layout)
    expected_q = (int(plan.qo_indptr[-1]), plan.num_qo_heads, plan.head_dim_qk)
    if tuple(q.shape) != expected_q or q.dtype != plan.q_data_type:
        raise ValueError(f"q is {q.dtype} {tuple(q.shape)}, the plan expects {plan.q_data_type} {expected_q}")
    expected_kv = (plan.page_size, plan.num_kv_heads)
    kv_dtypes = {k_cache.dtype, v_cache.dtype}
    if tuple(k_cache.shape[1:3]) != expected_kv or kv_dtypes != {plan.kv_data_type}:
        raise ValueError(
            f"KV pages are {k_cache.dtype} {tuple(k_cache.shape)}, the plan expects {plan.kv_data_type} "
            f"[pages, {plan.page_size}, {plan.num_kv_heads}, ...]"
        )
    if k_cache.shape[3] != plan.head_dim_qk or v_cache.shape[3] != plan.head_dim_vo:
        raise ValueError(
            f"head dims {k_cache.shape[3]}/{v_cache.shape[3]} differ from the planned "
            f"{plan.head_dim_qk}/{plan.head_dim_vo}"
        )
    if plan.kv_indices[: int(plan.kv_indptr[-1])].ge(k_cache.shape[0]).any():
        raise IndexError("a page index is out of range of the KV cache")
    seq_lens = get_seq_lens(plan.kv_indptr, plan.kv_last_page_len, plan.page_size).tolist()
    group = plan.num_qo_heads // plan.num_kv_heads
    out = torch.empty((q.shape[0], plan.num_qo_heads, plan.head_dim_vo), dtype=plan.o_data_type, device=q.device)
    lse = torch.empty((q.shape[0], plan.num_qo_heads), dtype=torch.float32, device=q.device)  # [N, Hq] base 2
    for b, kv_len in enumerate(seq_lens):
        q_start, q_end = int(plan.qo_indptr[b]), int(plan.qo_indptr[b + 1])
        if q_start == q_end:
            continue
        pages = plan.kv_indices[int(plan.kv_indptr[b]) : int(plan.kv_indptr[b + 1])].to(k_cache.device)
        keys = k_cache[pages].flatten(0, 1)[:kv_len].float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        values = v_cache[pages].flatten(0, 1)[:kv_len].float().repeat_interleave(group, dim=1)  # [L, Hq, Dv]
        scores = torch.einsum("nhd,lhd->hnl", q[q_start:q_end].float(), keys) * plan.sm_scale  # [Hq, n, L]
        q_pos = torch.arange(kv_len - (q_end - q_start), kv_len, device=q.device)[:, None]  # bottom-right aligned
        kv_pos = torch.arange(kv_len, device=q.device)[None, :]
        if plan.alibi_slopes is not None:
            scores = scores + plan.alibi_slopes.to(q.device)[:, None, None] * (kv_pos - q_pos)  # [Hq, n, L]
        if plan.logits_soft_cap > 0:
            scores = plan.logits_soft_cap * torch.tanh(scores / plan.logits_soft_cap)
        allowed = torch.ones((q_end - q_start, kv_len), dtype=torch.bool, device=q.device)
        if plan.causal:
            allowed &= kv_pos <= q_pos
        if plan.window_left >= 0:
            allowed &= kv_pos >= q_pos - plan.window_left
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[q_start:q_end] = torch.einsum("hnl,lhd->nhd", scores.softmax(dim=-1), values).to(plan.o_data_type)
        lse[q_start:q_end] = (scores.logsumexp(dim=-1) / math.log(2)).transpose(0, 1)  # [n, Hq]
    return out, lse


def _host_plan_buffer() -> torch.Tensor:
    """The real wrappers' host buffer for their plans (8 MiB, pinned there; nnrun swaps it for pageable memory)."""
    return torch.empty(64, dtype=torch.uint8)


class BatchPrefillWithPagedKVCacheWrapper:
    """Emulates flashinfer.BatchPrefillWithPagedKVCacheWrapper (prefill, append and mixed batches)."""

    calls: list[Call] = []  # replaced per module by make_fake_flashinfer

    @_recorded
    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: PosTensor = None,
        paged_kv_indptr_buf: PosTensor = None,
        paged_kv_indices_buf: PosTensor = None,
        paged_kv_last_page_len_buf: PosTensor = None,
        custom_mask_buf: PosTensor = None,
        mask_indptr_buf: PosTensor = None,
        backend: str = "auto",
        jit_args: Optional[list] = None,
        jit_kwargs: Optional[dict] = None,
        variant_owns_mask: bool = False,
    ) -> None:
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be NHD or HND, got {kv_layout!r}")
        if use_cuda_graph or custom_mask_buf is not None:
            raise NotImplementedError("the emulator has no CUDA-graph or custom-mask mode")
        self._pin_memory_int_workspace_buffer = _host_plan_buffer()
        self.float_workspace_buffer = float_workspace_buffer
        self.kv_layout = kv_layout
        self._plan: Optional[_Plan] = None
        self._info: dict = {}

    @_recorded
    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        head_dim_vo: Optional[int] = None,
        custom_mask: PosTensor = None,
        packed_custom_mask: PosTensor = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale: Optional[float] = None,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        q_data_type: Union[str, torch.dtype] = "float16",
        kv_data_type: Union[str, torch.dtype, None] = None,
        o_data_type: Union[str, torch.dtype, None] = None,
        non_blocking: bool = True,
        prefix_len_ptr: PosTensor = None,
        token_pos_in_items_ptr: PosTensor = None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr: PosTensor = None,
        seq_lens: PosTensor = None,
        seq_lens_q: PosTensor = None,
        block_tables: PosTensor = None,
        max_token_per_sequence: Optional[int] = None,
        max_sequence_kv: Optional[int] = None,
        fixed_split_size: Optional[int] = None,
        disable_split_kv: bool = False,
        uniform_q_len: Optional[int] = None,
    ) -> None:
        if custom_mask is not None or packed_custom_mask is not None:
            raise NotImplementedError("the emulator has no custom masks")
        self._plan = _make_plan(
            qo_indptr,
            paged_kv_indptr,
            paged_kv_indices,
            paged_kv_last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim_qk,
            head_dim_vo,
            page_size,
            causal,
            pos_encoding_mode,
            sm_scale,
            window_left,
            logits_soft_cap,
            q_data_type,
            kv_data_type,
            o_data_type,
        )
        self._info = {"plan": self._plan}

    @_recorded
    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: KVCache,
        *args,
        q_scale=None,
        k_scale=None,
        v_scale=None,
        out: PosTensor = None,
        lse: PosTensor = None,
        return_lse: bool = False,
        lse_base: str = "log2",
        lse_layout: str = "NH",
        enable_pdl: Optional[bool] = None,
        window_left: Optional[int] = None,
        sinks: PosTensor = None,
        kv_cache_sf=None,
        skip_softmax_threshold_scale_factor: Optional[float] = None,
        use_fp16_softmax: Optional[bool] = None,
        uses_spcompress: Optional[bool] = None,
    ) -> torch.Tensor:
        if lse_base != "log2" or lse_layout != "NH" or lse is not None:
            raise NotImplementedError("the emulator returns lse in base 2, layout NH, into a new tensor")
        return _run_planned(
            self,
            q,
            paged_kv_cache,
            out,
            window_left,
            return_lse,
            unsupported=bool(args) or sinks is not None or any(s is not None for s in (q_scale, k_scale, v_scale)),
        )


class BatchDecodeWithPagedKVCacheWrapper:
    """Emulates flashinfer.BatchDecodeWithPagedKVCacheWrapper (one new token per request)."""

    calls: list[Call] = []

    @_recorded
    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: PosTensor = None,
        paged_kv_indices_buffer: PosTensor = None,
        paged_kv_last_page_len_buffer: PosTensor = None,
        backend: str = "auto",
        jit_args: Optional[list] = None,
    ) -> None:
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be NHD or HND, got {kv_layout!r}")
        if use_cuda_graph:
            buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
            if not all(torch.is_tensor(b) for b in buffers):
                raise ValueError("the three paged_kv_*_buffer arguments must be tensors in cudagraph mode")
            if len(paged_kv_indptr_buffer) != len(paged_kv_last_page_len_buffer) + 1:
                raise ValueError("The size of paged_kv_indptr_buffer should be batch_size + 1")
        self.use_cuda_graph = use_cuda_graph
        self._buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        self._pin_memory_int_workspace_buffer = _host_plan_buffer()
        self.float_workspace_buffer = float_workspace_buffer
        self.kv_layout = kv_layout
        self.use_tensor_cores = use_tensor_cores
        self._plan: Optional[_Plan] = None
        self._info: dict = {}

    # The real plan() takes `*deprecated_positional_args, **kwargs` after page_size and forwards
    # them to a keyword-only implementation; these are that implementation's keywords.
    @_recorded
    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        window_right: int = 0,
        logits_soft_cap: Optional[float] = None,
        q_data_type: Union[str, torch.dtype, None] = "float16",
        kv_data_type: Union[str, torch.dtype, None] = None,
        o_data_type: Union[str, torch.dtype, None] = None,
        data_type: Union[str, torch.dtype, None] = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        non_blocking: bool = True,
        block_tables: PosTensor = None,
        seq_lens: PosTensor = None,
        fixed_split_size: Optional[int] = None,
        disable_split_kv: bool = False,
        q_len_per_req: int = 1,
        is_causal: Optional[bool] = None,
    ) -> None:
        if q_len_per_req != 1 or window_right != 0:
            raise NotImplementedError("the emulator decodes one token per request with window_right=0")
        batch_size = last_page_len.numel()
        qo_indptr = torch.arange(batch_size + 1, dtype=torch.int32)  # one query row per request
        self._plan = _make_plan(
            qo_indptr,
            indptr,
            indices,
            last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            head_dim,
            page_size,
            False,
            pos_encoding_mode,
            sm_scale,
            window_left,
            logits_soft_cap,
            q_data_type or data_type,
            kv_data_type or data_type,
            o_data_type,
        )
        self._info = {"plan": self._plan}
        if self.use_cuda_graph:
            indptr_buf, indices_buf, last_page_len_buf = self._buffers
            if batch_size != len(last_page_len_buf):
                raise ValueError(
                    f"The batch size should be fixed during the lifecycle of the wrapper in cudagraph "
                    f"mode, the runtime batch size {batch_size} mismatches the batch size "
                    f"{len(last_page_len_buf)} set during initialization."
                )
            if len(indices) > len(indices_buf):
                raise ValueError("The size of indices should be less than or equal to the allocated buffer")
            indptr_buf.copy_(indptr)
            last_page_len_buf.copy_(last_page_len)
            indices_buf[: len(indices)].copy_(indices)

    @_recorded
    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: KVCache,
        *args,
        q_scale=None,
        k_scale=None,
        v_scale=None,
        out: PosTensor = None,
        lse: PosTensor = None,
        return_lse: bool = False,
        enable_pdl: Optional[bool] = None,
        window_left: Optional[int] = None,
        sinks: PosTensor = None,
        q_len_per_req: Optional[int] = None,
        skip_softmax_threshold_scale_factor: Optional[float] = None,
        kv_cache_sf=None,
    ) -> torch.Tensor:
        # The query is the last token of its request: no key lies after it, so no causal mask is needed.
        if lse is not None:
            raise NotImplementedError("the emulator returns lse into a new tensor")
        if self.use_cuda_graph:
            return self._run_from_buffers(q, paged_kv_cache, out, window_left, return_lse)
        return _run_planned(
            self,
            q,
            paged_kv_cache,
            out,
            window_left,
            return_lse,
            unsupported=bool(args) or sinks is not None or any(s is not None for s in (q_scale, k_scale, v_scale)),
        )

    def _run_from_buffers(self, q, paged_kv_cache, out, window_left, return_lse):
        """Graph mode: one kernel launch that reads the page tables from the fixed buffers when it runs."""
        if self._plan is None:
            raise RuntimeError("plan() must be called before run()")
        planned = self._plan
        out = (
            out
            if out is not None
            else torch.empty(
                (q.shape[0], planned.num_qo_heads, planned.head_dim_vo), dtype=planned.o_data_type, device=q.device
            )
        )
        lse = torch.empty((q.shape[0], planned.num_qo_heads), dtype=torch.float32, device=q.device)  # [N, Hq]
        indptr_buf, indices_buf, last_page_len_buf = self._buffers

        def kernel() -> None:
            current = dataclasses.replace(
                planned,
                kv_indptr=indptr_buf.cpu().long(),
                kv_indices=indices_buf.cpu().long(),
                kv_last_page_len=last_page_len_buf.cpu().long(),
            )
            result, result_lse = _attend(current, q, paged_kv_cache, self.kv_layout, window_left)
            out.copy_(result)
            lse.copy_(result_lse)

        launch_kernel(kernel)
        self._info = {"plan": planned, "num_tokens": q.shape[0]}
        return (out, lse) if return_lse else out


def _run_planned(wrapper, q: torch.Tensor, paged_kv_cache, out, window_left, return_lse: bool, unsupported: bool):
    """What both wrappers' run() do: attend with the planned arrays, recording the call.

    Returns the output, or `(output, lse)` with `return_lse` (lse `[N, Hq]` float32, base 2).
    """
    if wrapper._plan is None:
        raise RuntimeError("plan() must be called before run()")
    if unsupported:
        raise NotImplementedError("the emulator implements the attention output and its lse only")
    result, lse = _attend(wrapper._plan, q, paged_kv_cache, wrapper.kv_layout, window_left)
    wrapper._info = {"plan": wrapper._plan, "num_tokens": q.shape[0]}
    if out is not None:
        out.copy_(result)
        result = out
    return (result, lse) if return_lse else result


def make_fake_flashinfer() -> types.ModuleType:
    """A fresh `flashinfer` stand-in whose wrappers record into its own `calls` list."""
    module = types.ModuleType("flashinfer")
    module.__version__ = "0.7.2.post1+torch-emulator"
    module.calls = []
    module.get_seq_lens = get_seq_lens
    for base in (BatchPrefillWithPagedKVCacheWrapper, BatchDecodeWithPagedKVCacheWrapper):
        setattr(module, base.__name__, type(base.__name__, (base,), {"calls": module.calls}))
    return module
