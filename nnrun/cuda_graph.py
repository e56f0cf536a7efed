"""CUDA graphs for decode steps: one graph per padded batch size, replayed when nothing watches the step.

A decode step of a few dozen requests spends most of its time launching kernels: hundreds per
layer stack, each a few microseconds of host work. Capturing the whole forward once per batch
size and replaying it removes that host cost. A graph replays kernels on fixed addresses, so the
step's inputs are copied into static buffers, a batch is padded up to the next captured size
(padding rows decode over the KV pool's trash page), and the attention backend re-plans its page
tables into buffers the graph reads. Python does not run during a replay: no module hooks, no
nnsight interventions and no autograd, so the runner replays only steps that have none of them.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from nnrun.attention import AttentionBackend, forward_context, hf_masks_skipped
from nnrun.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


def default_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to 256 (sglang's spacing), capped at `max_num_seqs`.

    A step pads to the next size, so the spacing bounds the wasted rows at 16 (or 2x below 16).
    """
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16))
    capped = [size for size in sizes if size < max_num_seqs]
    return capped + [min(max_num_seqs, 256)]


class CaptureRefused(RuntimeError):
    """The captured forward did something a replay could not repeat (a host read, a tensor subclass)."""


@dataclass(frozen=True)
class LazyCapture:
    """When a batch size's graph is captured, where graphs are not all captured at start (the CPU's traced ones).

    At the `after`-th decode step of that size that could replay it, if the fastest such step so far (the time
    between two of them in a row) took under `below_s` (None: any): a replay saves a step's Python, not its
    math, and a capture costs a few steps, repaid only where that Python is a fair share of the step.
    """

    after: int
    below_s: float | None = None


class SizeWatch:
    """Lazy captures per batch size: the steps that could replay each, the fastest of them (`LazyCapture`), and
    the failure that ends every capture after it (`refused`)."""

    def __init__(self, lazy: LazyCapture, clock: Callable[[], float] = time.perf_counter) -> None:
        self.lazy = lazy
        self.clock = clock
        self.seen: dict[int, int] = {}
        self._last: dict[int, float] = {}
        self.fastest: dict[int, float] = {}  # seconds between two steps of the size in a row, the fewest seen
        self.refused: str | None = None  # why a capture failed: no size is captured after it

    def capture_when_due(
        self,
        size: int,
        capture: Callable[[int], None],
        unwatched: Callable[[], AbstractContextManager],
        steps: str,
        graphs: str,
    ) -> bool:
        """Count a step of `size` and, when due, `capture(size)` under `unwatched()`; whether it is captured now.

        `steps` and `graphs` name what runs eagerly after a failure, and what failed to be captured.
        """
        if not self.due(size) or self.refused is not None:
            return False
        try:
            with unwatched():
                capture(size)
        except Exception as error:  # this step runs eagerly, and so does every later one
            self.refused = f"{type(error).__name__}: {error}"
            # A refusal is the model's forward being what it is (say, an MoE router reading the host): no cause
            # for alarm, the steps are as right and only as fast as before. Anything else is a fault.
            log = logger.info if isinstance(error, CaptureRefused) else logger.warning
            log("%s run eagerly: capturing %s failed (%s)", steps, graphs, self.refused)
            return False
        logger.info("captured %s of batch size %d", graphs, size)
        return True

    def due(self, size: int) -> bool:
        """Count a step of `size`; whether its graph should be captured now."""
        now = self.clock()
        last = self._last.get(size)
        self._last[size] = now
        if last is not None and now - last < self.fastest.get(size, math.inf):
            self.fastest[size] = now - last
        seen = self.seen[size] = self.seen.get(size, 0) + 1
        below = self.lazy.below_s
        return seen >= self.lazy.after and (below is None or self.fastest.get(size, 0.0) < below)


class GraphCapturer(Protocol):
    """Records `fn` as a graph: returns a replay function and what `fn` returned while recorded.

    `captures_attention`: whether the attention backend's calls are recorded inside the graph (CUDA's
    kernels), or run eagerly at replay between recorded pieces (`traced_graph.TracedCapturer`).
    """

    captures_attention: bool

    def capture(self, fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]: ...


class CudaGraphCapturer:
    """torch.cuda graphs sharing one memory pool (captured largest first, so smaller graphs reuse it)."""

    captures_attention = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        # Warm up on a side stream first: lazy initialisations (cuBLAS handles, workspace
        # allocations, FlashInfer's first plan) must not happen while capturing.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        # On tensor-parallel ranks the warm-up ran NCCL collectives: let them finish, so that NCCL's
        # watchdog thread has no event of theirs to query while this thread captures.
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        return graph.replay, output


class DecodeGraphRunner:
    """Captured decode forwards for `batch_sizes`, and their replay on a real decode step."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        trash_slot: int,
        backend: AttentionBackend,
        batch_sizes: Sequence[int],
        capturer: GraphCapturer,
        lazy: LazyCapture | None = None,
    ) -> None:
        """`trash_slot`: the KV slot padding rows write to (the pool's reserved slot nothing reads).

        `lazy`: None captures every size now; else each size when `lazy` says, at a decode step that could
        replay it (`takes`), so that sizes a run never holds for long cost nothing (the CPU's traced graphs).
        """
        if not batch_sizes or min(batch_sizes) <= 0:
            raise ValueError(f"CUDA graph batch sizes must be positive, got {list(batch_sizes)}")
        self.model = model
        self.backend = backend
        self.batch_sizes = sorted(set(batch_sizes))
        self.trash_slot = trash_slot
        max_batch_size = self.batch_sizes[-1]
        self.input_ids = torch.zeros(max_batch_size, dtype=torch.int64, device=device)  # [max_bs]
        self.positions = torch.zeros(max_batch_size, dtype=torch.int64, device=device)  # [max_bs]
        self.out_cache_loc = torch.full((max_batch_size,), self.trash_slot, dtype=torch.int64, device=device)
        self.replays: dict[int, Callable[[], None]] = {}
        self.logits: dict[int, torch.Tensor] = {}  # per size, the [bs, V] logits its replay writes
        self.capturer = capturer
        self.lazy = lazy
        self.watch = None if lazy is None else SizeWatch(lazy)
        self.num_replays = 0  # decode steps replayed so far (for benchmarks and tests)
        backend.init_cuda_graph_state(self.batch_sizes)
        if lazy is None:
            for batch_size in reversed(self.batch_sizes):
                self._capture(batch_size)
            logger.info("captured decode CUDA graphs for batch sizes %s", self.batch_sizes)

    def _capture(self, batch_size: int) -> None:
        self.prepare_capture(batch_size)
        self.replays[batch_size], self.logits[batch_size] = self.capturer.capture(self.forward_fn(batch_size))

    def prepare_capture(self, batch_size: int) -> None:
        """Load and plan a step of `batch_size` padding rows, which a capture's runs (`forward_fn`) decode."""
        # Rows an earlier step filled would write live requests' KV in the capture's runs: point them at the trash.
        self.input_ids[:batch_size].zero_()
        self.positions[:batch_size].zero_()
        self.out_cache_loc[:batch_size].fill_(self.trash_slot)
        # Planning copies page tables from the host: it runs before capture, never inside it.
        self.backend.init_forward_metadata_capture(batch_size, self.out_cache_loc[:batch_size])

    @property
    def refused(self) -> str | None:
        """Why a lazy capture failed (no size is captured after it); None while none has."""
        return None if self.watch is None else self.watch.refused

    def takes(self, batch_size: int, unwatched: Callable[[], AbstractContextManager] = nullcontext) -> bool:
        """Whether a decode step of `batch_size` rows replays a graph; counts the step towards a lazy capture.

        Asked once per decode step that could replay (nothing watches it); the size's graph is captured
        when `lazy` says, under `unwatched()` (the step is live: its module calls must serve no one).
        """
        graph_size = self.padded_batch_size(batch_size)
        if graph_size is None:
            return False
        return graph_size in self.replays or self.watch.capture_when_due(
            graph_size, self._capture, unwatched, "decode steps", "a decode graph"
        )

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def forward_fn(self, batch_size: int) -> Callable[[], torch.Tensor]:
        """One decode forward over the static buffers' first `batch_size` rows (all padding at capture)."""

        def forward() -> torch.Tensor:
            position_ids = self.positions[:batch_size][None]  # [1, bs]
            with (
                forward_context(self.backend, position_ids=position_ids),
                hf_masks_skipped(self.model),
                torch.no_grad(),
            ):
                output = self.model(
                    input_ids=self.input_ids[:batch_size][None],
                    position_ids=position_ids,
                    use_cache=False,
                    logits_to_keep=0,  # every row is some request's next token
                )
            return output.logits[0]  # [bs, V]

        return forward

    def padded_batch_size(self, batch_size: int) -> int | None:
        """The smallest captured size that holds `batch_size` rows; None above the largest."""
        index = bisect.bisect_left(self.batch_sizes, batch_size)
        return self.batch_sizes[index] if index < len(self.batch_sizes) else None

    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """The step's `[B, V]` next-token logits, from the graph of the next captured size.

        The returned rows are a view of the graph's output, rewritten by its next replay (on CPU, by any graph's
        next replay: the traced graphs' outputs share one buffer).
        """
        graph_size = self.load_step(forward_batch)
        self.replays[graph_size]()
        self.num_replays += 1
        return self.logits[graph_size][: forward_batch.batch_size]

    def load_step(self, forward_batch: ForwardBatch) -> int:
        """Copy the step into the static buffers and plan it into the graphs' page tables; its padded size.

        Whatever graph replays next (the whole step's, or decoder-layer pieces) reads these buffers.
        """
        batch_size = forward_batch.batch_size
        graph_size = self.padded_batch_size(batch_size)
        if graph_size is None:
            raise ValueError(f"no CUDA graph holds a batch of {batch_size} (largest: {self.max_batch_size})")
        self.input_ids[:batch_size].copy_(forward_batch.input_ids, non_blocking=True)
        self.positions[:batch_size].copy_(forward_batch.positions, non_blocking=True)
        self.out_cache_loc[:batch_size].copy_(forward_batch.out_cache_loc, non_blocking=True)
        if graph_size > batch_size:  # padding rows (CPU graphs have none: each size is its own)
            # Rows a larger earlier batch filled would write into live requests' KV: point them at the trash.
            self.input_ids[batch_size:graph_size].zero_()
            self.positions[batch_size:graph_size].zero_()
            self.out_cache_loc[batch_size:graph_size].fill_(self.trash_slot)
        self.backend.init_forward_metadata_replay(graph_size, forward_batch, self.out_cache_loc[:graph_size])
        return graph_size
