"""Text prompts tokenized by the client: the server takes the ids only from a tokenizer identical to its own.

Payloads from nnrun's client run by `run_trace` on an in-process `ServedLanguageModel`; the
oracle is the same trace run locally, on the text or on the ids the server should have used.
Forged ids prove that the server does run the ids it takes, so a match is not the server
quietly tokenizing the text again.
"""

from __future__ import annotations

import copy

import pytest
import torch

from nnrun.serve import client as client_module
from nnrun.serve import payload
from nnrun.serve.prompt_ids import tokenizer_fingerprint

PROMPT = "The Eiffel Tower is in"
OTHER = "The Colosseum is in"


def trace(model, prompt):
    with model.trace(prompt):
        hidden = model.model.layers[1].output[:, -1].save()
        logits = model.lm_head.output[:, -1].save()
    return hidden, logits


def assert_same(got, expected):
    for ours, theirs in zip(got, expected):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def send_ids(monkeypatch, fingerprint, ids):
    """The client ships `ids` for PROMPT under `fingerprint` (None: its own tokenizer's)."""

    def encode(tokenizer, own_fingerprint, inputs):
        return (fingerprint or own_fingerprint, {PROMPT: ids})

    monkeypatch.setattr(client_module, "encode_trace_prompts", encode)


def test_the_client_sends_its_ids_and_the_server_takes_them(served, client, local_model, payloads):
    assert client.tokenizer_fingerprint is not None
    assert client.tokenizer_fingerprint == served.tokenizer_fingerprint
    got = trace(client, PROMPT)
    loaded = payload.load_trace(payloads[-1], served)
    try:
        assert loaded.prompt_ids == {PROMPT: served.tokenizer(PROMPT)["input_ids"]}
    finally:
        loaded.release()
    assert_same(got, trace(local_model, PROMPT))


def test_the_server_runs_the_ids_it_takes(served, client, local_model, payloads, monkeypatch):
    other_ids = served.tokenizer(OTHER)["input_ids"]
    send_ids(monkeypatch, None, other_ids)
    got = trace(client, PROMPT)
    assert_same(got, trace(local_model, other_ids))
    assert not torch.allclose(got[1], trace(local_model, PROMPT)[1])  # the forged ids did change the answer


@pytest.mark.parametrize(
    "fingerprint, ids",
    [
        ("0" * 64, "other"),  # another tokenizer's ids
        (None, [10**9]),  # outside the vocabulary
        (None, [1.0, 2.0]),  # not token ids
        (None, []),
    ],
    ids=["other-tokenizer", "out-of-vocabulary", "floats", "empty"],
)
def test_ids_the_server_cannot_trust_are_tokenized_again(
    served, client, local_model, payloads, monkeypatch, fingerprint, ids
):
    send_ids(monkeypatch, fingerprint, served.tokenizer(OTHER)["input_ids"] if ids == "other" else ids)
    assert_same(trace(client, PROMPT), trace(local_model, PROMPT))


def _add_a_token(tokenizer):
    tokenizer.add_tokens(["Eiffel"])


def _drop_the_bos(tokenizer):
    from tokenizers.processors import TemplateProcessing

    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="$A", pair="$A $B")


@pytest.mark.parametrize("change", [_add_a_token, _drop_the_bos], ids=["added-token", "post-processor"])
def test_a_tokenizer_changed_after_loading_is_fingerprinted_again(served, client, local_model, payloads, change):
    original = client.tokenizer
    changed = copy.deepcopy(original)
    object.__setattr__(client, "tokenizer", changed)
    try:
        assert client.tokenizer_fingerprint == served.tokenizer_fingerprint
        change(changed)  # in place, after the fingerprint was taken
        assert changed(PROMPT)["input_ids"] != served.tokenizer(PROMPT)["input_ids"]
        assert client.tokenizer_fingerprint != served.tokenizer_fingerprint
        got = trace(client, PROMPT)
        loaded = payload.load_trace(payloads[-1], served)
        assert loaded.prompt_ids is None
        loaded.release()
        assert_same(got, trace(local_model, PROMPT))  # the server's tokenizer decides, as before the change
    finally:
        object.__setattr__(client, "tokenizer", original)


def test_the_fingerprint_follows_what_tokenizes(served):
    tokenizer = served.tokenizer
    assert tokenizer_fingerprint(copy.deepcopy(tokenizer)) == served.tokenizer_fingerprint
    added = copy.deepcopy(tokenizer)
    added.add_tokens(["<|eiffel|>"])
    splitting = copy.deepcopy(tokenizer)
    splitting.split_special_tokens = not tokenizer.split_special_tokens
    fingerprints = {served.tokenizer_fingerprint, tokenizer_fingerprint(added), tokenizer_fingerprint(splitting)}
    assert len(fingerprints) == 3
    assert tokenizer_fingerprint(None) is None and tokenizer_fingerprint(object()) is None
