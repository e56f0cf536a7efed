"""The tiny model, tokenizer and oracle the nnsight conformance suite runs on (built offline)."""

from __future__ import annotations

import copy
import warnings

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = (
    "the a of in is to and was on at by for with from city tower river bridge museum paris rome london berlin "
    "madrid eiffel colosseum big ben capital france italy england germany spain located famous old new red blue "
    "green cat dog sat mat ran fast slow one two three four five six seven eight nine ten hello world when mary "
    "john went store gave milk drink book read wrote house garden tree sun moon star night day"
).split()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer with a pad token and no EOS, so generations run their full length."""
    vocab = {"<pad>": 0, "<unk>": 1}
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>")
    tokenizer.padding_side = "left"
    return tokenizer


def tiny_llama(seed: int = 0, num_layers: int = 3) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def twin(model: torch.nn.Module) -> torch.nn.Module:
    """An independent copy with the same weights: nnsight-on-HF runs on this one."""
    return copy.deepcopy(model)


def oracle_and_nnrun(model: torch.nn.Module, tokenizer) -> tuple:
    """nnsight on a twin of `model` (the oracle) and nnrun's LanguageModel on `model` itself."""
    import nnrun

    return hf_language_model(twin(model), tokenizer), nnrun.LanguageModel(model, tokenizer=tokenizer)


def bundled_pair(name: str) -> tuple:
    """`oracle_and_nnrun` over one of nnrun's bundled models (`tiny-facts-gpt2`, ...), loaded from its folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nnrun.assets import bundled_model_path

    path = bundled_model_path(name)
    return oracle_and_nnrun(AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path))


def hf_language_model(model: torch.nn.Module, tokenizer) -> "object":
    """nnsight's own LanguageModel over the plain HF model: the oracle."""
    import nnsight

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return nnsight.LanguageModel(model, tokenizer=tokenizer)
