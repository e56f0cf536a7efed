import os
import sys
from pathlib import Path

# Nothing may come from a model hub in tests: fail fast instead of waiting on the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))

# Every test under these folders starts processes (servers, a Ray cluster, tensor-parallel ranks):
# they belong to `make test-all`, not to the fast tier. Elsewhere a module says so itself with
# `pytestmark = pytest.mark.slow`.
SLOW_FOLDERS = ("serve", "distributed", "tp")


def pytest_addoption(parser):
    parser.addoption(
        "--stress",
        action="store_true",
        help="run the repeated scenarios (interpreter exits) at their full counts, not a few each",
    )


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        folder = Path(item.path).relative_to(TESTS).parts[0] if Path(item.path).is_relative_to(TESTS) else ""
        if folder in SLOW_FOLDERS:
            item.add_marker(slow)


@pytest.fixture(scope="session")
def tiny_llm():
    """An LLM over a random Llama with a real (GPT-2 style byte-level) tokenizer built offline."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    import nnrun

    corpus = ["The cat sat on the mat.", "A dog ran in the park.", "Paris is in France."] * 20
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=tokenizer.eos_token_id,
    )
    llm = nnrun.LLM(LlamaForCausalLM(config).eval(), tokenizer=tokenizer)
    yield llm, tokenizer
    llm.shutdown()
