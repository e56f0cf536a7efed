"""The forward a model's steps run: packed (eager, or replaying decode graphs) or exact; chosen once per model.

`ModelRunner.load_model` builds the packed path with the pools a model needs beside its KV (mixer
states, indexer keys); `ModelRunner.choose_forward_path` keeps it or, when the load-time probe
finds that packed steps do not give HF's numbers, replaces it with the exact path (`nnrun/exact`).
`init_cuda_graphs` then gives the packed path its decode graphs (and decoder-layer pieces) where
they apply. Callers ask the path (`forward_groups`, `packs_requests`, `takes_graphs`, `forget`)
instead of testing which forward the model has.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Iterator

import torch

from nnrun.attention import AttentionBackend, forward_context, hf_masks_skipped
from nnrun.attention.indexer import IndexerKeyPool, serve_indexers
from nnrun.attention.probabilities import AttentionProbsPlan
from nnrun.cuda_graph import DecodeGraphRunner
from nnrun.exact import HFForward
from nnrun.forward_batch import (
    ForwardBatch,
    ForwardMode,
    decode_forward_batch,
    is_decode_step,
    next_decode_forward_batch,
    packed_forward_batch,
)
from nnrun.graph_pieces import DecoderLayerPieces
from nnrun.request import Request
from nnrun.state import StatePool, serve_states

if TYPE_CHECKING:
    from nnrun.model_runner import ModelRunner


class ForwardPath(ABC):
    """How one model's steps run forward; one subclass per variant, chosen once at load."""

    name: ClassVar[str]
    packs_requests: ClassVar[bool]  # one forward serves all of a step's requests (False: one forward each)
    # What the exact path has none of: pools beside the KV, decode graphs.
    state_pool: StatePool | None = None  # per-request recurrent state of mixer layers (nnrun/state)
    indexer_keys: IndexerKeyPool | None = None  # sparse-attention indexers' keys, beside the KV (attention/indexer)
    graphs: DecodeGraphRunner | None = None  # decode CUDA graphs, once captured (`ModelRunner.init_cuda_graphs`)
    pieces: DecoderLayerPieces | None = None  # the same, one graph per decoder layer (graph_pieces)

    @property
    def reason(self) -> str | None:
        """Why the model runs on this path, for logs and errors (None: nothing to explain)."""
        return None

    @property
    @abstractmethod
    def takes_graphs(self) -> bool:
        """Whether decode steps may replay captured CUDA graphs on this path."""

    @abstractmethod
    def forward_groups(self, reqs: list[Request]) -> list[list[Request]]:
        """The forwards a step's requests run in."""

    @abstractmethod
    def forward_batch(self, runner: ModelRunner, reqs: list[Request], mode: ForwardMode) -> ForwardBatch:
        """Every uncached token of each request (no chunking); the scheduler has allocated the pages."""

    @abstractmethod
    def decode_batch(self, runner: ModelRunner, reqs: list[Request]) -> ForwardBatch:
        """The layout of a decode step of `reqs`."""

    @abstractmethod
    def next_decode_batch(
        self, runner: ModelRunner, previous: ForwardBatch, next_token_ids: torch.Tensor
    ) -> ForwardBatch:
        """The decode step after `previous`, each request one token (`next_token_ids`, [B]) further."""

    @abstractmethod
    def run(self, runner: ModelRunner, forward_batch: ForwardBatch) -> torch.Tensor:
        """The step's forward -> logits `[R, V]`, the rows `forward_batch.logits_indices` names."""

    @abstractmethod
    def forget(self, request_ids: list[str]) -> None:
        """Drop what the path keeps for these finished or transient requests."""

    def release_graphs(self) -> None:
        """Drop the captured graphs; the decoder layers get their own classes back."""
        if self.pieces is not None:
            self.pieces.remove()
        self.graphs = self.pieces = None


@dataclass
class PackedPath(ForwardPath):
    """One packed `[1, N]` call of the HF model per step, over the paged KV (and the pools beside it)."""

    state_pool: StatePool | None = None
    indexer_keys: IndexerKeyPool | None = None
    graphs: DecodeGraphRunner | None = None
    pieces: DecoderLayerPieces | None = None
    # The backend of every step (the probe's torch-attention candidate); None: `runner.attention_backend_for`
    backend: AttentionBackend | None = None

    name: ClassVar[str] = "packed"
    packs_requests: ClassVar[bool] = True

    @property
    def takes_graphs(self) -> bool:
        # A replay would not run the mixers' per-request Python (nnrun/state), nor serve the indexers their
        # step's layout (attention/indexer), which a graph's forward does not enter
        return self.state_pool is None and self.indexer_keys is None

    def forward_groups(self, reqs: list[Request]) -> list[list[Request]]:
        return [reqs]

    def forward_batch(self, runner: ModelRunner, reqs: list[Request], mode: ForwardMode) -> ForwardBatch:
        return packed_forward_batch(
            reqs,
            mode,
            runner.req_to_token_pool.req_to_token,
            runner.allocator.page_size,
            [runner._wants_prompt_logits(req) for req in reqs],
            [runner.keeps_all_logits(req) for req in reqs],
        )

    def decode_batch(self, runner: ModelRunner, reqs: list[Request]) -> ForwardBatch:
        if reqs and is_decode_step(reqs):
            return decode_forward_batch(reqs, runner.req_to_token_pool.req_to_token, runner.allocator.page_size)
        return self.forward_batch(runner, reqs, ForwardMode.DECODE)  # mislabelled: the backend's planner refuses it

    def next_decode_batch(
        self, runner: ModelRunner, previous: ForwardBatch, next_token_ids: torch.Tensor
    ) -> ForwardBatch:
        if previous.req_pool_indices is None:
            return runner.prepare_forward_batch_decode(previous.reqs)
        return next_decode_forward_batch(
            previous, next_token_ids, runner.req_to_token_pool.req_to_token, runner.allocator.page_size
        )

    def forget(self, request_ids: list[str]) -> None:
        """Nothing to drop: a request's pages, table row and state pool row are freed with its KV."""

    def run(self, runner: ModelRunner, forward_batch: ForwardBatch) -> torch.Tensor:
        runner._ensure_paged_attention()
        if runner._replays_graph(forward_batch):
            return self.graphs.replay(forward_batch)  # [B, V]: a decode step keeps every row
        gate = runner._piece_gate(forward_batch)
        # Pieces read the graph buffers (planned first); the eager parts the step's ordinary plan.
        pieces = _NOTHING if gate is None else self.pieces.step(self.graphs.load_step(forward_batch), gate)
        backend = runner.attention_backend_for(forward_batch) if self.backend is None else self.backend
        backend.init_forward_metadata(forward_batch)
        device = runner.device
        # None unless a request of the step asked for attention probabilities
        probs_plan = AttentionProbsPlan.for_batch(forward_batch, device, runner.gather_heads)
        position_ids = forward_batch.positions.to(device)[None]  # [1, N]
        logits_indices = forward_batch.logits_indices.to(device)  # [R]
        with (
            forward_context(backend, probs_plan, position_ids),
            hf_masks_skipped(runner.model),
            runner.grad_context(forward_batch),
            self.pools_served(forward_batch, device),
            pieces,
        ):
            output = runner.model(
                input_ids=forward_batch.input_ids.to(device)[None],
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=0 if forward_batch.logits_of_every_token else logits_indices,  # 0: every position
            )
        runner.output_type = type(output)  # the model's own output class (GPT-2's differs from Llama's)
        if runner.returns_every_position:  # [N, V]: take the step's rows
            return output.logits[0].index_select(0, logits_indices)
        return output.logits[0]

    def pools_served(self, forward_batch: ForwardBatch, device: torch.device) -> AbstractContextManager:
        """The step's views of the pools beside the KV, around its forward (nothing to serve without pools)."""
        if self.state_pool is None and self.indexer_keys is None:
            return _NOTHING
        return _pools_served(self.state_pool, self.indexer_keys, forward_batch, device)


_NOTHING = nullcontext()  # reusable: entering it does nothing


@contextmanager
def _pools_served(
    state_pool: StatePool | None, indexer_keys: IndexerKeyPool | None, forward_batch: ForwardBatch, device: torch.device
) -> Iterator[None]:
    with serve_states(state_pool, forward_batch), serve_indexers(indexer_keys, forward_batch, device):
        yield


@dataclass
class ExactPath(ForwardPath):
    """Each request through HF's own forward and cache, one per forward (`nnrun/exact`).

    There HF's own caches hold the mixer states and indexer keys, and no graph is captured.
    """

    hf: HFForward

    name: ClassVar[str] = "exact"
    packs_requests: ClassVar[bool] = False

    @property
    def reason(self) -> str | None:
        return self.hf.reason

    @property
    def takes_graphs(self) -> bool:
        return False

    def forward_groups(self, reqs: list[Request]) -> list[list[Request]]:
        self.hf.forget_released()  # preempted since the last step: their HF caches go with their pages
        return [[req] for req in reqs]

    def forward_batch(self, runner: ModelRunner, reqs: list[Request], mode: ForwardMode) -> ForwardBatch:
        if len(reqs) != 1:
            raise RuntimeError(f"the exact path runs one request per forward, got {len(reqs)}")
        return self.hf.forward_batch(reqs[0], runner._wants_prompt_logits(reqs[0]), runner.keeps_all_logits(reqs[0]))

    def decode_batch(self, runner: ModelRunner, reqs: list[Request]) -> ForwardBatch:
        return self.forward_batch(runner, reqs, ForwardMode.DECODE)

    def next_decode_batch(
        self, runner: ModelRunner, previous: ForwardBatch, next_token_ids: torch.Tensor
    ) -> ForwardBatch:
        return runner.prepare_forward_batch_decode(previous.reqs)  # its layout is read off each request's tokens

    def run(self, runner: ModelRunner, forward_batch: ForwardBatch) -> torch.Tensor:
        with runner.grad_context(forward_batch):
            logits, runner.output_type = self.hf.run(forward_batch)  # [R, V]
        return logits

    def forget(self, request_ids: list[str]) -> None:
        self.hf.forget(request_ids)
