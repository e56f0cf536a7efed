"""A step crosses to the ranks as one int64 buffer; each rank rebuilds the front end's ForwardBatch from it."""

import pytest
import torch

import nnrun.tp.wire as wire
from nnrun.forward_batch import OUTPUT_ATTENTIONS_ARG, ForwardMode, decode_forward_batch, packed_forward_batch
from nnrun.memory import ReqToTokenPool, TokenToKVPoolAllocator, hold_kv
from nnrun.request import Request
from nnrun.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PAGE_SIZE = 4


def _requests(lengths: list[int]) -> tuple[list[Request], ReqToTokenPool]:
    allocator, table = TokenToKVPoolAllocator(64, PAGE_SIZE), ReqToTokenPool(8, 128)
    allocator.alloc(3)  # pages 0..2 taken: the requests' pages do not start at 0
    reqs = []
    for i, length in enumerate(lengths):
        req = Request(str(i), list(range(10 + i, 10 + i + length)), SamplingParams())
        assert hold_kv(req, length + 3, allocator, table)  # a page more than needed: only the used ones travel
        reqs.append(req)
    return reqs, table


def _assert_same_batch(ours, theirs):
    assert ours.forward_mode is theirs.forward_mode
    for name in ("input_ids", "positions", "out_cache_loc", "logits_indices"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    assert ours.extend_seq_lens == theirs.extend_seq_lens
    assert ours.extend_start_loc == theirs.extend_start_loc
    assert ours.prefix_lens == theirs.prefix_lens
    assert ours.attention_probs_rows == theirs.attention_probs_rows
    for row in range(theirs.batch_size):  # every slot of each request's KV, up to its length
        assert torch.equal(ours.kv_slots[row], theirs.kv_slots[row]), row


def test_an_extend_step_is_rebuilt_exactly():
    reqs, table = _requests([7, 3, 12])
    packed_forward_batch(reqs[2:], ForwardMode.EXTEND, table.req_to_token, PAGE_SIZE, [False])  # an earlier step
    reqs[2].num_computed_tokens = 5  # ... cached the first 5 tokens of the third request
    reqs[1].extra_args[OUTPUT_ATTENTIONS_ARG] = True
    batch = packed_forward_batch(reqs, ForwardMode.EXTEND, table.req_to_token, PAGE_SIZE, [False, True, False])
    rebuilt = wire.decode_step(bytes(wire.encode_step(batch, PAGE_SIZE)), PAGE_SIZE)
    _assert_same_batch(rebuilt, batch)
    assert rebuilt.kv_slot_table is None


def test_a_decode_step_is_rebuilt_exactly():
    reqs, table = _requests([9, 5, 14])
    packed_forward_batch(reqs, ForwardMode.EXTEND, table.req_to_token, PAGE_SIZE, [False] * 3)
    for req in reqs:  # the prefill ran; each request brings one sampled token
        req.num_computed_tokens = req.num_tokens
        req.output_token_ids.append(3)
    batch = decode_forward_batch(reqs, table.req_to_token, PAGE_SIZE)
    rebuilt = wire.decode_step(bytes(wire.encode_step(batch, PAGE_SIZE)), PAGE_SIZE)
    _assert_same_batch(rebuilt, batch)
    seq_lens = torch.tensor(batch.seq_lens)
    within = torch.arange(batch.kv_slot_table.shape[1]) < seq_lens[:, None]  # entries past a length are never read
    assert torch.equal(rebuilt.kv_slot_table[within], batch.kv_slot_table[within])


def test_answers_and_errors_round_trip():
    logits = torch.randn(3, 11)
    for kind, tensor in [
        (wire.MessageKind.LOGITS, logits),
        (wire.MessageKind.LOGITS, logits.to(torch.bfloat16)),
        (wire.MessageKind.LOGITS, logits.to(torch.float16)),
        (wire.MessageKind.TOKEN_IDS, logits.argmax(-1)),
        (wire.MessageKind.LOGITS, logits[:0]),
    ]:
        header, payload = wire.encode_tensor(kind, tensor)
        assert wire.message_kind(header) is kind
        decoded = wire.decode_tensor(header, bytearray(payload))
        assert decoded.dtype == tensor.dtype and torch.equal(decoded, tensor)
    assert wire.decode_error(wire.encode_error(1, "Traceback: boom")) == (1, "Traceback: boom")


def test_the_step_says_what_rank_0_answers():
    reqs, table = _requests([5])
    batch = packed_forward_batch(reqs, ForwardMode.EXTEND, table.req_to_token, PAGE_SIZE, [False])
    for reply in wire.StepReply:
        assert wire.step_reply(bytes(wire.encode_step(batch, PAGE_SIZE, reply))) is reply
