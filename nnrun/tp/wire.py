"""What crosses the pipe between the front end and its ranks: a step as one int64 buffer, its answer as raw bytes.

A step is described by the tokens it runs and where their KV lives: token ids, positions and
slots (`[N]` each), per request its cached prefix length, its new tokens, its page table and
whether it asked for attention probabilities (`[B]`, `[B, max_pages]`), and the flat positions
whose logits are kept (`[R]`). Each rank rebuilds the same `ForwardBatch` from these numbers
with the same formulas the front end used; no Python object crosses per token or per request.
"""

from __future__ import annotations

import enum
import pickle
from dataclasses import dataclass

import numpy as np
import torch

from nnrun.forward_batch import OUTPUT_ATTENTIONS_ARG, ForwardBatch, ForwardMode, TableRows


class MessageKind(enum.IntEnum):
    STEP = 1  # front end -> every rank: run this step
    STOP = 2  # front end -> every rank: leave the loop and exit
    LOGITS = 3  # rank 0 -> front end: the step's logits rows
    TOKEN_IDS = 4  # rank 0 -> front end: each row's argmax (a step of plain greedy rows only)
    ERROR = 5  # any rank -> front end: a traceback; that rank exits after sending it
    READY = 6  # every rank -> front end, once loaded: rank 0 adds what the front end must mirror
    PROFILE_START = 7  # front end -> every rank: time collectives from now on
    PROFILE_STOP = 8  # front end -> every rank: stop timing; rank 0 answers with STATS
    STATS = 9  # rank 0 -> front end: the window's wall time and collective time
    # A runner's own exchange (the nnsight bridge ships traces, steps with them, finished requests):
    # a pickled payload to every rank, which the rank runner's `serve_exchange` answers on rank 0.
    EXCHANGE = 10
    EXCHANGE_REPLY = 11  # rank 0 -> front end: the pickled answer


class StepReply(enum.IntEnum):
    """What rank 0 sends back for a step."""

    LOGITS = 0  # the logits rows: the front end's sampler decides
    ARGMAX = 1  # each row's argmax: every row is greedy with nothing else asked of its logits


_MODE_CODES = {ForwardMode.EXTEND: 0, ForwardMode.DECODE: 1}
_MODES = {code: mode for mode, code in _MODE_CODES.items()}
_HEADER_LEN = 7  # kind, mode, num_tokens, batch_size, num_logits_rows, max_pages, reply


def encode_step(forward_batch: ForwardBatch, page_size: int, reply: StepReply = StepReply.LOGITS) -> memoryview:
    """The step as one int64 buffer: a header, then the arrays in a fixed order."""
    reqs = forward_batch.reqs
    seq_lens = forward_batch.seq_lens
    pages_per_req = [-(-seq // page_size) for seq in seq_lens]  # only the pages that hold this step's KV
    max_pages = max(pages_per_req, default=0)
    page_table = np.zeros((len(reqs), max_pages), dtype=np.int64)  # [B, max_pages]; padding is never read
    for row, (req, num_pages) in enumerate(zip(reqs, pages_per_req)):
        page_table[row, :num_pages] = req.page_ids[:num_pages]
    wants_probs = np.zeros(len(reqs), dtype=np.int64)  # [B]
    wants_probs[forward_batch.attention_probs_rows] = 1
    header = np.array(
        [
            MessageKind.STEP,
            _MODE_CODES[forward_batch.forward_mode],
            forward_batch.num_tokens,
            len(reqs),
            len(forward_batch.logits_indices),
            max_pages,
            reply,
        ],
        dtype=np.int64,
    )
    buffer = np.concatenate(
        [
            header,
            forward_batch.input_ids.numpy(),
            forward_batch.positions.numpy(),
            forward_batch.out_cache_loc.numpy(),
            np.asarray(forward_batch.prefix_lens, dtype=np.int64),
            np.asarray(forward_batch.extend_seq_lens, dtype=np.int64),
            wants_probs,
            page_table.ravel(),
            forward_batch.logits_indices.numpy(),
        ]
    )
    return memoryview(buffer)


def encode_kind(kind: MessageKind) -> bytes:
    """A message that is only its kind (STOP, PROFILE_START, PROFILE_STOP)."""
    return np.array([kind], dtype=np.int64).tobytes()


def message_kind(message: bytes) -> MessageKind:
    return MessageKind(int(np.frombuffer(message, dtype=np.int64, count=1)[0]))


def step_reply(message: bytes) -> StepReply:
    return StepReply(int(np.frombuffer(message, dtype=np.int64, count=_HEADER_LEN)[-1]))


@dataclass
class ShippedRequest:
    """What a rank knows of a request: its KV pages, and whether it asked for attention probabilities."""

    page_ids: list[int]
    extra_args: dict
    request_id: str = ""  # not sent: a plain step's rows are anonymous on the ranks (runners look ids up and find none)


def decode_step(message: bytes, page_size: int) -> ForwardBatch:
    """The `ForwardBatch` the front end built, rebuilt from `encode_step`'s buffer."""
    values = torch.frombuffer(bytearray(message), dtype=torch.int64)  # a private copy the batch may keep
    _, mode, num_tokens, batch_size, num_rows, max_pages, _ = values[:_HEADER_LEN].tolist()
    sizes = [num_tokens, num_tokens, num_tokens, batch_size, batch_size, batch_size, batch_size * max_pages, num_rows]
    (input_ids, positions, out_cache_loc, prefix_lens, extend_lens, wants_probs, pages, logits_indices) = values[
        _HEADER_LEN:
    ].split(sizes)
    page_table = pages.view(batch_size, max_pages)  # [B, max_pages]
    prefix_lens, extend_lens = prefix_lens.tolist(), extend_lens.tolist()
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    # [B, max_pages * page_size] -> [B, max_seq_len]: slot of position p is page[p // ps] * ps + p % ps,
    # the front end's formula; entries past a request's length are never read.
    slot_table = (page_table[:, :, None] * page_size + torch.arange(page_size)).view(batch_size, -1)
    slot_table = slot_table[:, : max(seq_lens, default=0)]
    reqs = [
        ShippedRequest(row.tolist(), {OUTPUT_ATTENTIONS_ARG: True} if wants else {})
        for row, wants in zip(page_table, wants_probs.tolist())
    ]
    forward_mode = _MODES[mode]
    starts = np.cumsum([0] + extend_lens[:-1]).tolist() if batch_size else []
    return ForwardBatch(
        forward_mode=forward_mode,
        reqs=reqs,
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=out_cache_loc,
        extend_seq_lens=extend_lens,
        extend_start_loc=starts,
        prefix_lens=prefix_lens,
        kv_slots=TableRows(slot_table, [seq - 1 for seq in seq_lens]),
        logits_indices=logits_indices,
        next_token_logits_rows=[],  # the front end picks rows from the logits it gets back
        prompt_logits_rows=[],
        kv_slot_table=slot_table if forward_mode is ForwardMode.DECODE else None,
    )


# Logits and token ids travel as their raw bytes behind a small header: kind, dtype code, shape.
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64]


def encode_tensor(kind: MessageKind, tensor: torch.Tensor) -> list[memoryview | bytes]:
    """LOGITS `[R, V]` or TOKEN_IDS `[R]` as (header, payload) for `send_bytes`; the payload is a view, not a copy."""
    tensor = tensor.detach().to("cpu").contiguous()
    shape = list(tensor.shape) + [1] * (2 - tensor.dim())
    header = np.array([kind, _DTYPES.index(tensor.dtype), tensor.dim(), *shape], dtype=np.int64)
    return [header.tobytes(), memoryview(tensor.reshape(-1).view(torch.uint8).numpy())]


def decode_tensor(header: bytes, payload: bytearray) -> torch.Tensor:
    _, dtype_code, ndim, *shape = np.frombuffer(header, dtype=np.int64).tolist()
    dtype, shape = _DTYPES[dtype_code], shape[:ndim]
    if not payload:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(payload, dtype=torch.uint8).view(dtype).view(shape)


def encode_report(kind: MessageKind, report: dict) -> bytes:
    """READY or STATS: sent once per load or profiling window (never per step), so a pickle is fine here."""
    return np.array([kind], dtype=np.int64).tobytes() + pickle.dumps(report)


def decode_report(message: bytes) -> dict:
    return pickle.loads(message[8:])


def encode_exchange(kind: MessageKind, payload: bytes) -> bytes:
    """EXCHANGE or EXCHANGE_REPLY: a runner's own message, already serialized by the runner."""
    return np.array([kind], dtype=np.int64).tobytes() + payload


def exchange_payload(message: bytes) -> bytes:
    return bytes(message[8:])


def encode_error(rank: int, text: str) -> bytes:
    return np.array([MessageKind.ERROR, rank], dtype=np.int64).tobytes() + text.encode()


def decode_error(message: bytes) -> tuple[int, str]:
    rank = int(np.frombuffer(message, dtype=np.int64, count=2)[1])
    return rank, bytes(message[16:]).decode(errors="replace")
