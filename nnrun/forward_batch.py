"""ForwardBatch: the device tensors and per-request layout of one engine step."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Sequence

import torch

from nnrun.request import Request

# `Request.extra_args` key: serve this request's attention probabilities as each attention module's
# second output (HF's `output_attentions`); see nnrun/attention/probabilities.py.
OUTPUT_ATTENTIONS_ARG = "output_attentions"


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # at least one request brings more than one new token (a prefill)
    DECODE = "decode"  # every request brings exactly one new token after a cached prefix
    IDLE = "idle"


@dataclass
class ForwardBatch:
    """All new tokens of the scheduled requests, flattened into one `[N]` sequence."""

    forward_mode: ForwardMode
    reqs: list[Request]  # batch order
    input_ids: torch.Tensor  # [N] int64 (on the CPU, or a decode chain's sampled tokens on the model's device)
    positions: torch.Tensor  # [N] int64, each request's absolute positions (HF position_ids)
    out_cache_loc: torch.Tensor  # [N] int64 KV slot written for each new token
    extend_seq_lens: list[int]  # new tokens per request
    extend_start_loc: list[int]  # first flat index of each request's tokens
    prefix_lens: list[int]  # cached tokens per request before this step
    kv_slots: Sequence[torch.Tensor]  # per request [seq_len] int64 slots of its whole KV after this step
    logits_indices: torch.Tensor  # [R] int64 flat positions whose logits are computed
    next_token_logits_rows: list[int]  # per request, its row in the logits output (None-free: every request samples)
    prompt_logits_rows: list[tuple[int, int] | None] = field(default_factory=list)  # per request [start, end) rows
    # [B, max_seq_len] int64: row b's first seq_lens[b] entries are kv_slots[b]; the rest is stale (any slot).
    # Set for decode steps, so a backend can read the whole page table in one tensor instead of B of them.
    kv_slot_table: torch.Tensor | None = None
    req_pool_indices: torch.Tensor | None = None  # [B] int64 request-table rows; set for decode steps
    # `attention_probs_rows` once read (a request asks at submission, for its whole life): a decode chain's
    # next step keeps it, so the per-request scan runs once per chain, not once per step
    known_attention_probs_rows: list[int] | None = field(default=None, repr=False)
    # `logits_indices` is every token's row, in order (a decode step's `arange(N)`): the model may keep them all
    logits_of_every_token: bool = False
    # Decode steps after this one in which every request still writes into its current page (0: unknown, or some
    # request enters a new page next step): a decode chain's next step then advances slots without a page lookup
    num_steps_in_pages: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def attention_probs_rows(self) -> list[int]:
        """Rows whose requests asked for their attention probabilities."""
        if self.known_attention_probs_rows is None:
            self.known_attention_probs_rows = [
                row for row, req in enumerate(self.reqs) if req.extra_args.get(OUTPUT_ATTENTIONS_ARG)
            ]
        return self.known_attention_probs_rows

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_seq_lens)]


class TableRows(Sequence[torch.Tensor]):
    """Row b of a `[B, L]` table cut at `lengths[b] + 1`, made only when asked for (most steps never ask)."""

    def __init__(self, table: torch.Tensor, last_indices: list[int]) -> None:
        self.table = table
        self.last_indices = last_indices

    def __len__(self) -> int:
        return len(self.last_indices)

    def __getitem__(self, row: int) -> torch.Tensor:
        return self.table[row, : self.last_indices[row] + 1]


def decode_forward_batch(reqs: list[Request], req_to_token: torch.Tensor, page_size: int) -> ForwardBatch:
    """A DECODE step: each request brings one token after its cached prefix.

    Built from plain ints and one read of the request table (`req_to_token`, updated in place with
    the new tokens' slots), not from per-request tensors: its cost is the engine's fixed cost per step.
    """
    positions = [req.num_tokens - 1 for req in reqs]
    slots = [req.page_ids[pos // page_size] * page_size + pos % page_size for req, pos in zip(reqs, positions)]
    rows = torch.tensor([req.req_pool_idx for req in reqs], dtype=torch.int64)  # [B]
    position_tensor = torch.tensor(positions, dtype=torch.int64)  # [B]
    slot_tensor = torch.tensor(slots, dtype=torch.int64)  # [B]
    req_to_token[rows, position_tensor] = slot_tensor
    kv_slot_table = req_to_token[rows, : max(positions) + 1]  # [B, max_seq_len] (a copy: later steps cannot change it)
    num_reqs = len(reqs)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        reqs=reqs,
        input_ids=torch.tensor([(req.output_token_ids or req.prompt_token_ids)[-1] for req in reqs], dtype=torch.int64),
        positions=position_tensor,
        out_cache_loc=slot_tensor,
        extend_seq_lens=[1] * num_reqs,
        extend_start_loc=list(range(num_reqs)),
        prefix_lens=positions,
        kv_slots=TableRows(kv_slot_table, positions),
        logits_indices=torch.arange(num_reqs, dtype=torch.int64),
        next_token_logits_rows=list(range(num_reqs)),
        prompt_logits_rows=[None] * num_reqs,
        kv_slot_table=kv_slot_table,
        req_pool_indices=rows,
        logits_of_every_token=True,
        num_steps_in_pages=page_size - 1 - max(pos % page_size for pos in positions),
    )


def next_decode_forward_batch(
    previous: ForwardBatch, next_token_ids: torch.Tensor, req_to_token: torch.Tensor, page_size: int
) -> ForwardBatch:
    """The decode step after `previous` for the same requests, in the same order, each one token further.

    The caller guarantees that each request appended exactly `next_token_ids[b]` since `previous`
    (the engine's decode chain), and that the scheduler holds a page for each new position. Nothing
    is read per request but the new page of those that enter one (one in `page_size` steps): positions
    and slots advance by one in whole-batch ops, and the request table gets the new slots in one write.
    While every request stays in its page (`num_steps_in_pages`), no request is even looked for.
    """
    assert previous.forward_mode is ForwardMode.DECODE and previous.req_pool_indices is not None
    rows = previous.req_pool_indices
    positions = previous.positions + 1  # [B] int64
    position_list = positions.tolist()
    slots = previous.out_cache_loc + 1  # [B] int64; right for every request that stays in its page
    num_steps_in_pages = previous.num_steps_in_pages - 1
    if num_steps_in_pages < 0:  # some request may enter a new page: look up the first slots of those that do
        offsets = positions % page_size  # [B] int64
        entering = (offsets == 0).nonzero().flatten()  # [E] int64
        if entering.numel():
            reqs = previous.reqs
            new_pages = [reqs[row].page_ids[position_list[row] // page_size] for row in entering.tolist()]
            slots[entering] = torch.tensor(new_pages, dtype=torch.int64) * page_size  # [E] their first slots
        num_steps_in_pages = page_size - 1 - int(offsets.max())
    req_to_token.index_put_((rows, positions), slots)
    kv_slot_table = req_to_token[rows, : previous.kv_slot_table.shape[1] + 1]  # [B, max_seq_len] (a copy)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        reqs=previous.reqs,
        # [B], as the token lists end now; left on the sampler's device, so a step can follow the last on the
        # GPU without a sync (a multi-step window's tokens reach the host after its last step)
        input_ids=next_token_ids.to(dtype=torch.int64),
        positions=positions,
        out_cache_loc=slots,
        extend_seq_lens=previous.extend_seq_lens,
        extend_start_loc=previous.extend_start_loc,
        prefix_lens=position_list,
        kv_slots=TableRows(kv_slot_table, position_list),
        logits_indices=previous.logits_indices,
        next_token_logits_rows=previous.next_token_logits_rows,
        prompt_logits_rows=previous.prompt_logits_rows,
        kv_slot_table=kv_slot_table,
        req_pool_indices=rows,
        known_attention_probs_rows=previous.known_attention_probs_rows,
        logits_of_every_token=previous.logits_of_every_token,
        num_steps_in_pages=num_steps_in_pages,
    )


def token_layout_plain(
    reqs: list[Request], prefix_lens: list[int], seq_lens: list[int], page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each new token's position, KV slot and request-table row (`[N]` each), from plain ints."""
    spans = list(zip(reqs, prefix_lens, seq_lens))
    positions = [pos for _, prefix, seq in spans for pos in range(prefix, seq)]
    slots = [
        req.page_ids[pos // page_size] * page_size + pos % page_size
        for req, prefix, seq in spans
        for pos in range(prefix, seq)
    ]
    rows = [req.req_pool_idx for req, prefix, seq in spans for _ in range(seq - prefix)]
    return (
        torch.tensor(positions, dtype=torch.int64),
        torch.tensor(slots, dtype=torch.int64),
        torch.tensor(rows, dtype=torch.int64),
    )


def token_layout_tensor(
    reqs: list[Request], prefix_lens: list[int], seq_lens: list[int], page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As `token_layout_plain`, in whole-batch tensor ops (a large step)."""
    q_lens = [seq - prefix for seq, prefix in zip(seq_lens, prefix_lens)]
    starts = list(itertools.accumulate(q_lens, initial=0))[:-1]
    token_to_req = torch.repeat_interleave(torch.arange(len(reqs)), torch.tensor(q_lens, dtype=torch.int64))  # [N]
    offsets = torch.tensor([prefix - start for prefix, start in zip(prefix_lens, starts)], dtype=torch.int64)  # [B]
    positions = torch.arange(len(token_to_req)) + offsets[token_to_req]  # [N]
    max_pages = max((len(req.page_ids) for req in reqs), default=0)
    page_table = torch.tensor(
        [req.page_ids + [0] * (max_pages - len(req.page_ids)) for req in reqs], dtype=torch.int64
    ).view(len(reqs), max_pages)  # [B, max_pages]
    out_cache_loc = page_table[token_to_req, positions // page_size] * page_size + positions % page_size  # [N]
    rows = torch.tensor([req.req_pool_idx for req in reqs], dtype=torch.int64)  # [B]
    return positions, out_cache_loc, rows[token_to_req]


def is_decode_step(reqs: list[Request]) -> bool:
    """Every request brings exactly one new token after a cached prefix."""
    return all(0 < req.num_computed_tokens == req.num_tokens - 1 for req in reqs)


# Up to this many new tokens, a step's slots and positions are faster built from plain ints (a few
# comprehensions, one tensor each) than by the whole-batch tensor ops, which cost about 0.15 ms
# whatever the size: 3% of a one-prompt 8-token trace on a small model.
PLAIN_LAYOUT_MAX_TOKENS = 128


def packed_forward_batch(
    reqs: list[Request],
    mode: ForwardMode,
    req_to_token: torch.Tensor,
    page_size: int,
    wants_prompt_logits: list[bool],
    keeps_all_logits: list[bool] | None = None,
) -> ForwardBatch:
    """Every uncached token of each request, flattened (the scheduler has allocated the pages).

    Slots and positions come from plain ints for a small step, else from a few whole-batch tensor
    ops, whatever the number of requests; the request table (`req_to_token`) records the new
    tokens' slots in place. The logits layout is decided here, once: a request keeps every new
    token's logits when it wants prompt logprobs or `keeps_all_logits` says so (a traced prompt,
    whose logits are HF's `[1, T, V]`), else its last token's.
    """
    keeps_all_logits = keeps_all_logits or [False] * len(reqs)
    prefix_lens = [req.num_computed_tokens for req in reqs]
    seq_lens = [req.num_tokens for req in reqs]
    q_lens = [seq - prefix for seq, prefix in zip(seq_lens, prefix_lens)]
    starts = list(itertools.accumulate(q_lens, initial=0))
    num_tokens = starts.pop()
    layout = token_layout_plain if num_tokens <= PLAIN_LAYOUT_MAX_TOKENS else token_layout_tensor
    positions, out_cache_loc, token_rows = layout(reqs, prefix_lens, seq_lens, page_size)
    req_to_token[token_rows, positions] = out_cache_loc
    rows = torch.tensor([req.req_pool_idx for req in reqs], dtype=torch.int64)  # [B]
    kv_slot_table = req_to_token[rows, : max(seq_lens, default=0)]  # [B, max_seq_len] (a copy)
    input_ids, logits_indices, next_rows, prompt_rows = [], [], [], []
    for req, prefix, start, q_len, wants, keeps_all in zip(
        reqs, prefix_lens, starts, q_lens, wants_prompt_logits, keeps_all_logits
    ):
        input_ids.extend(req.all_token_ids[prefix:])
        prompt_rows.append((len(logits_indices), len(logits_indices) + q_len - 1) if wants else None)
        if wants or keeps_all:  # every new position's logits (prompt logprobs, a trace's), the next token's last
            logits_indices.extend(range(start, start + q_len))
        else:
            logits_indices.append(start + q_len - 1)
        next_rows.append(len(logits_indices) - 1)
    return ForwardBatch(
        forward_mode=mode,
        reqs=reqs,
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=positions,
        out_cache_loc=out_cache_loc,
        extend_seq_lens=q_lens,
        extend_start_loc=starts,
        prefix_lens=prefix_lens,
        kv_slots=TableRows(kv_slot_table, [seq - 1 for seq in seq_lens]),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
        next_token_logits_rows=next_rows,
        prompt_logits_rows=prompt_rows,
    )
