"""The shortcut in reading a text prompt gives exactly HF's ids.

The oracle: HF's own `tokenizer(text)["input_ids"]`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import nnrun
from conformance.models import tiny_tokenizer
from nnrun.prompts import tokenize_prompt

ASSETS = Path(nnrun.__file__).parent / "assets"
VOCAB_SIZE = 10**6  # every id the tokenizers make is in range: only the ids are compared here

TEXTS = [
    "The Eiffel Tower is located in the city of",
    " a leading space",
    "a trailing space ",
    "two  spaces,\na newline\tand a tab",
    "ünïcödé ✓ 😀 日本語 \u00a0",
    "<|bos|> special tokens as text <|eos|> <eos> <pad>",
    "Paris",
    "paris is in france the cat sat on the mat",
]


def _byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """The GPT-2 style tokenizer of the `tiny_llm` fixture."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = ["The cat sat on the mat.", "A dog ran in the park.", "Paris is in France."] * 20
    backend.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")


TOKENIZERS = {
    "tiny-facts": lambda: AutoTokenizer.from_pretrained(ASSETS / "tiny-facts"),
    "tiny-facts-gpt2": lambda: AutoTokenizer.from_pretrained(ASSETS / "tiny-facts-gpt2"),
    "word-level": tiny_tokenizer,
    "byte-level": _byte_level_tokenizer,
}


def ours(text: str, tokenizer) -> list[int]:
    return tokenize_prompt(text, "prompt", tokenizer, VOCAB_SIZE)[1]


def hfs(text: str, tokenizer) -> list[int]:
    return tokenizer(text)["input_ids"]


@pytest.fixture(params=list(TOKENIZERS))
def tokenizer(request):
    return TOKENIZERS[request.param]()


def test_a_text_prompt_has_hfs_ids_without_hfs_encoding_objects(tokenizer, monkeypatch):
    calls = []
    real = tokenizer._encode_plus
    monkeypatch.setattr(tokenizer, "_encode_plus", lambda *a, **k: calls.append(1) or real(*a, **k))
    for text in TEXTS:
        assert ours(text, tokenizer) == hfs(text, tokenizer), text
    assert len(calls) == len(TEXTS)  # only the oracle's calls: the prompts took the shortcut


@pytest.mark.parametrize(
    "settings",
    [
        dict(add_bos_token=True),
        dict(add_eos_token=True),
        dict(add_bos_token=True, add_eos_token=True),
        dict(split_special_tokens=True),
    ],
)
def test_tokenizer_settings_a_user_changes_reach_the_shortcut(tokenizer, settings):
    """`tokenizer_kwargs` are set as attributes (as nnsight does); the ids follow them as HF's do."""
    if "add_bos_token" in settings and tokenizer.bos_token is None:
        settings = {"bos_token": tokenizer.eos_token or tokenizer.pad_token, **settings}  # set before add_bos_token
    for name, value in settings.items():
        setattr(tokenizer, name, value)
    for text in TEXTS:
        first = ours(text, tokenizer)  # before HF's own call has brought its backend in line
        assert first == hfs(text, tokenizer) == ours(text, tokenizer), text


@pytest.mark.parametrize(
    "enable", [lambda backend: backend.enable_truncation(2), lambda backend: backend.enable_padding(length=40)]
)
def test_a_backend_left_truncating_or_padding_gives_hfs_untruncated_unpadded_ids(tokenizer, enable):
    expected = [hfs(text, tokenizer) for text in TEXTS]
    for text, ids in zip(TEXTS, expected):
        enable(tokenizer._tokenizer)
        assert ours(text, tokenizer) == ids, text  # HF's __call__ resets the backend: so does this


def test_a_text_longer_than_the_tokenizer_allows_warns_once_as_on_hf():
    text = "the city of " * 100
    oracle, tokenizer = TOKENIZERS["tiny-facts"](), TOKENIZERS["tiny-facts"]()
    assert len(ours(text, tokenizer)) > tokenizer.model_max_length  # not truncated, as HF's
    assert ours(text, tokenizer) == hfs(text, oracle)
    assert tokenizer.deprecation_warnings == oracle.deprecation_warnings != {}  # its warning is marked given


class _ShoutingTokenizer(PreTrainedTokenizerFast):
    """A tokenizer class that changes a step of `__call__`: the shortcut must not bypass it."""

    def __call__(self, text, **kwargs):
        return super().__call__(text.upper(), **kwargs)


class _TranslatingTokenizer(PreTrainedTokenizerFast):
    """A translation tokenizer's language mode switch (NLLB's, Marian's) runs in `__call__`."""

    def _switch_to_input_mode(self):
        self.calls.append("input mode")


def test_a_tokenizer_class_that_changes_a_step_keeps_its_own_path():
    backend = TOKENIZERS["word-level"]()._tokenizer
    shouting = _ShoutingTokenizer(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>")
    assert ours("the city of paris", shouting) == hfs("THE CITY OF PARIS", TOKENIZERS["word-level"]())
    translating = _TranslatingTokenizer(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>")
    translating.calls = []
    assert ours("the city of paris", translating) == hfs("the city of paris", translating)
    assert translating.calls == ["input mode"] * 2


def test_a_trace_of_text_runs_on_hfs_ids():
    model = nnrun.LanguageModel("tiny-facts")
    try:
        text = TEXTS[0]
        with model.trace(text):
            from_text = model.lm_head.output.save()
        with model.trace(model.tokenizer(text)["input_ids"]):
            from_ids = model.lm_head.output.save()
        assert from_text.shape[1] == len(hfs(text, model.tokenizer)) and from_text.equal(from_ids)
    finally:
        model.shutdown()


# ---- sampling settings --------------------------------------------------------------------
