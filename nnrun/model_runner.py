"""ModelRunner: owns the HF model, the KV pools and the attention backend; runs one step."""

from __future__ import annotations

import logging
import sys
import threading
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch.nn.modules import module as nn_module
from torch.utils.hooks import RemovableHandle

from nnrun.attention import ATTN_IMPLEMENTATION, AttentionBackend, TorchAttnBackend
from nnrun.attention.classic import adapt_classic_attention
from nnrun.attention.indexer import IndexerKeyPool, adapt_indexers
from nnrun.attention.selection import create_attention_backend
from nnrun.compiled_layers import plain_own_forward, with_compiled_layers
from nnrun.config import EngineConfig
from nnrun.cuda_graph import CudaGraphCapturer, DecodeGraphRunner, GraphCapturer, LazyCapture, default_batch_sizes
from nnrun.exact import FORCED_REASON, HFForward, choose_exact_forward, packed_layers
from nnrun.forward_batch import OUTPUT_ATTENTIONS_ARG, ForwardBatch, ForwardMode
from nnrun.forward_path import ExactPath, ForwardPath, PackedPath
from nnrun.grad_modes import GradOff, InferenceOn
from nnrun.graph_pieces import DecoderLayerPieces, PieceGate, capture_decoder_layer_pieces, decoder_layers
from nnrun.loader import load_model, max_context_len, packed_unfit_reason
from nnrun.memory import hold_kv, release_kv
from nnrun.model_probe import AttentionLayerInfo
from nnrun.output_layout import returns_every_position
from nnrun.position_adapters import adapt_positions, max_positions
from nnrun.request import Request
from nnrun.runner_memory import KVPoolSetup
from nnrun.sampler import Sampler, SamplerOutput, SamplingRow
from nnrun.sampling_params import SamplingParams
from nnrun.state import StatePool, state_pool_for
from nnrun.traced_graph import CPU_CAPTURE_AFTER, CPU_CAPTURE_BELOW_S_PER_LAYER, TracedCapturer

logger = logging.getLogger(__name__)


@dataclass
class GraphPlan:
    """How a runner's decode graphs are made: by whom, when (None: all at start), which sizes, and whether
    decoder-layer pieces come with them (`graph_pieces`)."""

    capturer: GraphCapturer
    lazy: LazyCapture | None
    batch_sizes: list[int]
    pieces: bool


@dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor  # [B, V] one row per request (its last new token), batch order
    hidden_states: torch.Tensor | None = None
    prompt_logits: list[torch.Tensor | None] | None = None  # per request [T-1, V] when prompt logprobs are asked


class ModelRunner(KVPoolSetup):
    """Runs the unmodified HF module tree over one flat packed batch per step."""

    captures_on_ranks = False  # extraction hooks this process's modules (tensor-parallel runners: the ranks')
    gather_heads = None  # a tensor-parallel rank's all-gather of attention probabilities over the heads

    captures_graph_pieces = False  # per-layer decode graphs for watched steps (a runner that has a `piece_gate`)

    _hookless_at_handle = -1  # `RemovableHandle.next_id` when a scan last found no module hooks (`_has_module_hooks`)

    attn_implementation: str = ATTN_IMPLEMENTATION  # the name the model's config keeps for its attention (load_model)

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device.device)
        self.sampler = Sampler()
        self.step_lock = threading.RLock()  # one forward at a time: engine steps and run_prefill_only
        self.eos_token_ids: set[int] = set()  # set by the engine; used for min_tokens
        # How each step runs forward (nnrun/forward_path.py): load_model gives the packed path the model's
        # pools, choose_forward_path keeps it or takes the exact path, init_cuda_graphs adds its graphs.
        self.path: ForwardPath = PackedPath()

    # ---- lifecycle -------------------------------------------------------------------------
    def initialize(self) -> None:
        self.load_model()
        self.init_memory_pool()
        self.init_attention_backend()
        self.choose_forward_path()
        self.init_cuda_graphs()

    def load_model(self) -> None:
        loaded = load_model(self.config.model, self.config.device)
        self.model, self.tokenizer, self.model_name = loaded.model, loaded.tokenizer, loaded.name
        self.dtype = self.config.device.torch_dtype
        self.model.set_attn_implementation(ATTN_IMPLEMENTATION)
        # What the model's config names after that: its own eager/sdpa where it cannot take ours (families
        # whose attention is their own code: nnrun/attention/classic routes them, not the interface).
        self.attn_implementation = self.model.config._attn_implementation
        adapt_positions(self.model)  # modules that number positions themselves take each request's own
        # Mixer layers (state-space, linear attention) run per request on a state pool row beside each request's KV.
        state_pool = state_pool_for(self.model, self.config.scheduler.max_num_seqs + 1, self.device)
        adapt_classic_attention(self.model)  # families whose attention is their own code (GPT-J, Bloom, ...)
        # DSA sparse attention (DeepSeek-V3.2 and kin): each request's indexer picks from its own keys, kept paged
        indexers = adapt_indexers(self.model)
        indexer_keys = IndexerKeyPool(indexers, self.dtype, self.device) if indexers else None
        self.path = PackedPath(state_pool=state_pool, indexer_keys=indexer_keys)  # until the probe says otherwise
        self.layers: list[AttentionLayerInfo] = []
        # Why the packed path cannot serve this model, known before any packed step runs (None: ask the probe).
        self.packed_unfit: str | None = (
            FORCED_REASON if self.config.model.forward_path == "exact" else packed_unfit_reason(self.model.config)
        )
        if self.packed_unfit is None:
            self.layers, self.packed_unfit = packed_layers(self.model, self.device)
        # Decided once: a model that ignores logits_to_keep (Whisper's decoder) has its rows taken by the runner.
        self.returns_every_position = self.packed_unfit is None and returns_every_position(self.model, self.device)
        self._modules = list(self.model.modules())  # checked for hooks before each graph replay
        model_len = min(max_context_len(self.model.config), max_positions(self.model) or sys.maxsize)
        self.max_model_len = min(self.config.model.max_model_len or model_len, model_len)

    def choose_forward_path(self) -> None:
        """Probe the model at load: the packed path serves it only if it gives HF's own numbers.

        Otherwise every step runs each request through HF's own forward and cache (`nnrun.exact`);
        a model whose own HF forward fails is refused here, naming its family.
        """
        with self.step_lock:
            hf = choose_exact_forward(self, self.path, self.packed_unfit)
        if hf is None:
            return  # load_model's packed path serves it
        self.path = ExactPath(hf)  # HF's own caches hold the states and indexer keys there
        if self.layers:  # the probe rejected it: no paged KV is needed
            self.layers = []
            self._build_kv_cache(self.allocator.num_pages)
            self.init_attention_backend()

    def forward_groups(self, reqs: list[Request]) -> list[list[Request]]:
        """The forwards a step's requests run in: one packed forward, or one per request on the exact path."""
        return self.path.forward_groups(reqs)

    # Read-only views of the path, for callers that read them (tests, benchmarks)
    @property
    def exact_forward(self) -> HFForward | None:
        """The exact path's HF forward, or None on the packed path."""
        return self.path.hf if isinstance(self.path, ExactPath) else None

    @property
    def graph_runner(self) -> DecodeGraphRunner | None:
        return self.path.graphs

    @property
    def graph_pieces(self) -> DecoderLayerPieces | None:
        return self.path.pieces

    @property
    def state_pool(self) -> StatePool | None:
        return self.path.state_pool

    @property
    def indexer_keys(self) -> IndexerKeyPool | None:
        return self.path.indexer_keys

    def _build_kv_cache(self, num_pages: int) -> None:
        super()._build_kv_cache(num_pages)
        if self.path.indexer_keys is not None and self.layers:  # no layers: bound for the exact path, HF caches them
            self.path.indexer_keys.allocate(self.kv_pool)

    def init_attention_backend(self) -> None:
        self.attn_backend: AttentionBackend = create_attention_backend(
            self.config.device.attention_backend, self.kv_pool, self.device, self.layers
        )
        logger.info("nnrun attention backend: %s", self.attn_backend.name)

    def torch_attention_backend(self) -> AttentionBackend:
        """The pure-torch backend over the same KV pool (autograd-friendly), created on first use."""
        if isinstance(self.attn_backend, TorchAttnBackend):
            return self.attn_backend
        if getattr(self, "_torch_backend", None) is None:
            self._torch_backend = TorchAttnBackend(self.kv_pool, self.device)
        return self._torch_backend

    def init_cuda_graphs(self, capturer: GraphCapturer | None = None) -> None:
        """Decode graphs where the device has them (`device_graphs`), unless disabled or the path takes none.

        `capturer` stands in for CUDA's graph capture (the CPU tests pass a recording one): every size now.
        """
        self.path.release_graphs()
        if not self.config.device.enable_cuda_graphs or not self.path.takes_graphs:
            return
        device = self.config.device
        if capturer is not None:
            sizes = default_batch_sizes(self.config.scheduler.max_num_seqs)
            plan = GraphPlan(capturer, None, sizes, device.graph_pieces_on())
        else:
            plan = self.device_graphs()
        if plan is None:
            return
        capturer = with_compiled_layers(plan.capturer, self.model, device, self.own_forward)
        backend = self.attn_backend
        if not (backend.supports_cuda_graphs if capturer.captures_attention else backend.plans_graph_steps):
            logger.info("decode steps run eagerly: the %s attention backend cannot run in decode graphs", backend.name)
            return
        sizes = device.cuda_graph_batch_sizes or plan.batch_sizes
        with self.step_lock:
            self.path.graphs = DecodeGraphRunner(
                self.model, self.device, self.kv_pool.trash_slot, backend, sizes, capturer, plan.lazy
            )
            # Decided once: pieces for a runner whose steps may be watched, on one process (not tensor-parallel ranks)
            if self.captures_graph_pieces and plan.pieces and self.config.parallel.tensor_parallel_size == 1:
                self.path.pieces = capture_decoder_layer_pieces(self.model, self.path.graphs, capturer)

    def device_graphs(self) -> GraphPlan | None:
        """This device's decode graphs, or None (decode steps run eagerly).

        CUDA's graphs, every size at start, batches padded to the next size. On CPU (one process: a
        rank's collectives stay eager), the step's ops traced, attention included where it can be (`traced_graph`),
        every batch its own size (a padded batch's matmuls would round differently from the eager
        step's), each at its `CPU_CAPTURE_AFTER`-th step where its steps take under
        `CPU_CAPTURE_BELOW_S_PER_LAYER` per decoder layer.
        """
        max_num_seqs, device = self.config.scheduler.max_num_seqs, self.config.device
        if self.device.type == "cuda":
            sizes = default_batch_sizes(max_num_seqs)
            return GraphPlan(CudaGraphCapturer(self.device), None, sizes, device.graph_pieces_on())
        if self.device.type == "cpu" and self.config.parallel.tensor_parallel_size == 1:
            sizes = list(range(1, max_num_seqs + 1))
            num_layers = len(decoder_layers(self.model) or ()) or 1
            lazy = LazyCapture(CPU_CAPTURE_AFTER, CPU_CAPTURE_BELOW_S_PER_LAYER * num_layers)
            # Attention joins the traces unless sizes asked for pad some batches (`TracedCapturer.folds_attention`)
            asked = device.cuda_graph_batch_sizes
            folds = not asked or sorted(asked) == list(range(1, max(asked) + 1))
            capturer = TracedCapturer(self.attn_backend, max_num_seqs, folds_attention=folds)
            return GraphPlan(capturer, lazy, sizes, device.graph_pieces_on())
        return None

    def own_forward(self, module: torch.nn.Module) -> Callable | None:
        """A module's own forward under the wrappers this runner installs (compiled layers call it in captures)."""
        return plain_own_forward(module)

    def can_use_cuda_graph(self, forward_batch: ForwardBatch) -> bool:
        """Whether this step may replay a captured graph: a decode step nothing watches.

        A replay runs no Python, so module hooks would silently not fire and no attention
        probabilities would be computed; subclasses with interventions in the step say no as well.
        """
        return (
            forward_batch.forward_mode is ForwardMode.DECODE
            and not forward_batch.attention_probs_rows
            and not self._has_module_hooks()
        )

    def _has_module_hooks(self) -> bool:
        if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
            return True
        # Every hook registered since the last scan took a new handle id: none taken, none added
        if self._hookless_at_handle == RemovableHandle.next_id:
            return False
        if any(module._forward_hooks or module._forward_pre_hooks for module in self._modules):
            return True
        self._hookless_at_handle = RemovableHandle.next_id
        return False

    def _replays_graph(self, forward_batch: ForwardBatch) -> bool:
        """Whether this step replays a decode graph (asked once per step: it counts towards a lazy capture)."""
        if not (self._graphs_fit(forward_batch) and self.can_use_cuda_graph(forward_batch)):
            return False
        return self.graph_runner.takes(forward_batch.batch_size, self.unwatched)

    def unwatched(self) -> AbstractContextManager:
        """A seam: module calls inside serve no block (a lazy capture's runs, in the middle of a step)."""
        return nullcontext()

    def _graphs_fit(self, forward_batch: ForwardBatch) -> bool:
        """Whether the captured decode graphs can serve this step's batch size and kernels (watchers aside)."""
        graphs = self.graph_runner
        return (
            graphs is not None
            and graphs.padded_batch_size(forward_batch.batch_size) is not None
            and self.attention_backend_for(forward_batch) is graphs.backend
        )

    def _piece_gate(self, forward_batch: ForwardBatch) -> PieceGate | None:
        """The gate of a decode step that runs in decoder-layer pieces, or None (the whole step eager).

        The base runner's graph conditions (a decode step, no attention probabilities, no module hooks),
        not a subclass's: a subclass refuses whole-step graphs for the very steps pieces serve.
        """
        if (
            self.graph_pieces is None
            or not self._graphs_fit(forward_batch)
            or not ModelRunner.can_use_cuda_graph(self, forward_batch)
        ):
            return None
        gate = self.piece_gate(forward_batch)
        if gate is None or not self.graph_pieces.takes(forward_batch.batch_size, self.unwatched):
            return None
        return gate

    def piece_gate(self, forward_batch: ForwardBatch) -> PieceGate | None:
        """A seam: which decoder layers of a watched decode step run eagerly (None: the whole step does)."""
        return None

    def attention_backend_for(self, forward_batch: ForwardBatch) -> AttentionBackend:
        """The backend that serves this step; subclasses may pick the torch one (e.g. for autograd)."""
        return self.attn_backend

    def failure(self) -> BaseException | None:
        """Why this runner can no longer run steps, or None (a tensor-parallel group can fail for good)."""
        return None

    def shutdown(self) -> None:
        """Free the pools; called on the engine thread as it ends (by `LLM.shutdown` if none ran)."""
        self.path.release_graphs()  # the caller's model gets its layers' own classes back
        self.kv_pool = None
        self.attn_backend = None

    @property
    def is_generation(self) -> bool:
        return bool(getattr(self.model, "can_generate", lambda: True)())

    @property
    def sliding_window_size(self) -> int | None:
        windows = [layer.sliding_window for layer in self.layers if layer.sliding_window is not None]
        return max(windows) if windows else None

    # ---- one step -------------------------------------------------------------------------
    def prepare_forward_batch_extend(self, reqs: list[Request]) -> ForwardBatch:
        return self._prepare_forward_batch(reqs, ForwardMode.EXTEND)

    def prepare_forward_batch_decode(self, reqs: list[Request]) -> ForwardBatch:
        return self.path.decode_batch(self, reqs)

    def advance_decode_batch(self, previous: ForwardBatch, next_token_ids: torch.Tensor) -> ForwardBatch:
        """The decode step after `previous`, for its requests each one token (`next_token_ids`, [B]) further.

        The engine calls this only when nothing else changed between the two steps (its decode chain);
        the layout is what `prepare_forward_batch_decode` builds, updated in whole-batch ops.
        """
        return self.path.next_decode_batch(self, previous, next_token_ids)

    def _prepare_forward_batch(self, reqs: list[Request], mode: ForwardMode) -> ForwardBatch:
        """Every uncached token of each request (no chunking); the scheduler has allocated the pages."""
        return self.path.forward_batch(self, reqs, mode)

    def packed_step(self, forward_batch: ForwardBatch, path: PackedPath | None = None) -> LogitsProcessorOutput:
        """A packed step on `path` (the load-time probe's candidates; default the runner's own), whatever a
        subclass does around a step."""
        logits = self.run_model(forward_batch) if path is None else path.run(self, forward_batch)
        return self.process_logits(logits, forward_batch)

    def keeps_all_logits(self, req: Request) -> bool:
        """Whether `req` keeps every new token's logits this step (a seam: the nnsight runner's traces do)."""
        return False

    def allows_multi_step(self, reqs: list[Request]) -> bool:
        """Whether `reqs` may run several decode steps per scheduling decision (`nnrun/multi_step.py`; a seam).

        Not on the exact path (its layout is read off each request's tokens), nor while module hooks or a
        request's attention probabilities watch the forwards: rows of a request that stopped inside a window
        run on, and a watcher would see them. Subclasses whose requests are watched per step say no as well.
        """
        return (
            self.path.packs_requests
            and not any(req.extra_args.get(OUTPUT_ATTENTIONS_ARG) for req in reqs)
            and not self._has_module_hooks()
        )

    @staticmethod
    def _wants_prompt_logits(req: Request) -> bool:
        return (
            req.sampling_params.prompt_logprobs is not None
            and req.prompt_logprobs is None
            and req.num_computed_tokens == 0
            and len(req.prompt_token_ids) > 1
        )

    def forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """One packed `[1, N]` call of the HF model, then the logits rows the step needs."""
        logits = self.run_model(forward_batch)  # [R, V]
        return self.process_logits(logits, forward_batch)

    def run_model(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """The step's forward on the model's path -> logits `[R, V]`."""
        return self.path.run(self, forward_batch)

    def _ensure_paged_attention(self) -> None:
        """Someone switched the model's attention (a shared config, set_attn_implementation): switch back.

        Any other implementation would attend across the packed requests' boundaries by position
        heuristics at best, and ignore the KV cache at decode.
        """
        config = self.model.config
        # First read past the config's own `__getattribute__` (a remapping lookup that costs more than the check);
        # a config that keeps the name elsewhere gets the full check
        if object.__getattribute__(config, "__dict__").get("_attn_implementation_internal") == self.attn_implementation:
            return
        if config._attn_implementation != self.attn_implementation:
            logger.warning(
                "the model's attention implementation was changed to %r outside nnrun; restoring %r",
                self.model.config._attn_implementation,
                self.attn_implementation,
            )
            self.model.set_attn_implementation(self.attn_implementation)

    def grad_context(self, forward_batch: ForwardBatch) -> AbstractContextManager:
        """Autograd is off for serving; subclasses turn it on for requests that ask for gradients.

        A decode step that a captured graph could replay (the path takes graphs and nothing watches the
        step) runs in inference mode when it runs eagerly: torch then dispatches each op without autograd's
        bookkeeping (about a tenth of a small model's CPU step). As with a replay, none of its tensors reaches
        user code (its logits leave the forward as a copy), and it makes no tensor that a later step, outside
        inference mode, could update in place: the pools it writes were made before.
        """
        if self.path.takes_graphs and self.can_use_cuda_graph(forward_batch):
            return InferenceOn()
        return GradOff()

    @staticmethod
    def process_logits(logits: torch.Tensor, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        if forward_batch.forward_mode is ForwardMode.DECODE and logits.shape[0] == forward_batch.batch_size:
            # One row per request, in batch order: the rows are all of them (a copy, as a gather would make).
            return LogitsProcessorOutput(next_token_logits=logits.clone())
        prompt_logits = [
            None if rows is None else logits[rows[0] : rows[1]] for rows in forward_batch.prompt_logits_rows
        ]
        return LogitsProcessorOutput(
            next_token_logits=logits[forward_batch.next_token_logits_rows],
            prompt_logits=prompt_logits if any(p is not None for p in prompt_logits) else None,
        )

    def sample(self, logits_output: LogitsProcessorOutput, forward_batch: ForwardBatch) -> SamplerOutput:
        reqs = forward_batch.reqs
        shared = shared_sampling_params(reqs)  # every row the same settings: sampled in whole-batch ops
        with GradOff():
            logits = logits_output.next_token_logits  # [B, V]
            if shared is None or shared.min_tokens > 0:
                logits = self._mask_stops_before_min_tokens(logits, reqs)
            if shared is not None:
                return self.sampler.sample_shared(logits, shared)
            rows = [
                SamplingRow(req.sampling_params, req.prompt_token_ids, req.output_token_ids, req.generator)
                for req in reqs
            ]
            return self.sampler(logits, rows)

    def _mask_stops_before_min_tokens(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Rows still short of `min_tokens` cannot pick EOS or a stop token (HF's min_new_tokens).

        Rows are grouped by their `SamplingParams` object (one for a whole batch that shares its settings), so a
        step's Python per row is a length check: each group's stop tokens are worked out once, and its rows are
        masked by one indexed write, or by columns when every row of the step is in it.
        """
        vocab_size = logits.shape[-1]
        short: dict[int, tuple[list[int], list[int]]] = {}  # id(params) -> (its stop tokens, its short rows)
        for row, req in enumerate(reqs):
            params = req.sampling_params
            if len(req.output_token_ids) >= params.min_tokens:
                continue
            group = short.get(id(params))
            if group is None:
                stops = sorted(t for t in {*self.eos_token_ids, *params.stop_token_ids} if 0 <= t < vocab_size)
                group = short[id(params)] = (stops, [])
            group[1].append(row)
        groups = [(stops, rows) for stops, rows in short.values() if stops]
        if not groups:  # nobody short, or nothing to forbid (no EOS, no stop tokens): the logits as they are
            return logits
        logits = logits.clone()  # [B, V]; the caller's logits (nnsight's model.logits) stay as served
        for stops, rows in groups:
            if len(rows) == len(reqs):
                logits[:, stops] = float("-inf")
            else:  # every (row, stop token) pair of the group
                logits[torch.tensor(rows)[:, None], torch.tensor(stops)[None, :]] = float("-inf")
        return logits

    def requests_to_blame(self, reqs: list[Request]) -> list[Request]:
        """After a failed step: the requests whose own code caused it (to end them and re-run the rest).

        The plain engine runs no user code in a step, so nothing is to blame but the engine.
        """
        return []

    def finish_requests(self, reqs: list[Request]) -> None:
        """Called by the engine once requests have finished; subclasses collect per-request results."""
        self.path.forget([req.request_id for req in reqs])

    # ---- extraction -----------------------------------------------------------------------
    def run_prefill_only(self, token_id_lists: list[list[int]]) -> ForwardBatch:
        """One packed forward of several prompts with no logits; their KV is freed right after.

        Module hooks registered by the caller see the flat `[1, N, ...]` values; prompt i owns
        tokens `extend_start_loc[i] : extend_start_loc[i] + extend_seq_lens[i]`.
        """
        if not self.path.packs_requests and len(token_id_lists) > 1:
            raise ValueError(
                f"this model runs on the exact path (one HF forward per prompt): run_prefill_only "
                f"takes one prompt at a time there, got {len(token_id_lists)}"
            )
        with self.step_lock, self._transient_requests(token_id_lists) as reqs:
            forward_batch = self.prepare_forward_batch_extend(reqs)
            forward_batch.logits_indices = torch.zeros(0, dtype=torch.int64)
            forward_batch.next_token_logits_rows = []
            forward_batch.prompt_logits_rows = [None] * len(reqs)
            self.run_model(forward_batch)
            return forward_batch

    @contextmanager
    def _transient_requests(self, token_id_lists: list[list[int]]) -> Iterator[list[Request]]:
        """Requests the scheduler never sees, for one forward: KV held on entry, freed on exit."""
        reqs = [Request(f"transient-{i}", list(ids), _PREFILL_PARAMS) for i, ids in enumerate(token_id_lists)]
        try:
            for req in reqs:
                self._hold_kv(req)
            yield reqs
        finally:
            for req in reqs:
                self.release_kv(req)
            self.path.forget([req.request_id for req in reqs])

    def _hold_kv(self, req: Request) -> None:
        if not 0 < req.num_tokens <= self.req_to_token_pool.max_context_len:
            raise ValueError(f"prompt of {req.num_tokens} tokens does not fit the KV pool / context")
        if not hold_kv(req, req.num_tokens, self.allocator, self.req_to_token_pool):
            raise RuntimeError("the KV pool is full; pass fewer or shorter prompts per call")

    def release_kv(self, req: Request) -> None:
        """Free a request's pages and table row (safe to call twice)."""
        release_kv(req, self.allocator, self.req_to_token_pool)


def shared_sampling_params(reqs: list[Request]) -> SamplingParams | None:
    """The one SamplingParams object every request holds, if it needs no per-row work (penalties, own RNG)."""
    if not reqs:
        return None
    params = reqs[0].sampling_params
    if params.has_penalties or params.seed is not None:
        return None
    if all(req.sampling_params is params and req.generator is None for req in reqs):
        return params
    return None


_PREFILL_PARAMS = SamplingParams(max_tokens=1)
