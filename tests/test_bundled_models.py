"""Bundled tiny models: they know the facts table, and patching at the subject moves the answer."""

import json
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2LMHeadModel, LlamaForCausalLM

from nnrun.assets import (
    BUNDLED_MODELS,
    FACTS_PATH,
    bundled_model_path,
    is_bundled_model,
    load_facts,
)
from nnrun.assets.corpus import all_fact_records, build_corpus
from nnrun.assets.train_tiny import TrainConfig, build_model, build_tokenizer, train

MIN_FACT_ACCURACY = 0.95
MAX_TOTAL_MEGABYTES = 20


@pytest.fixture(scope="module", params=BUNDLED_MODELS)
def model_and_tokenizer(request):
    path = bundled_model_path(request.param)
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def tiny_facts():
    path = bundled_model_path("tiny-facts")
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def answer_token_id(tokenizer, answer: str) -> int:
    (token_id,) = tokenizer(answer, add_special_tokens=False)["input_ids"]
    return token_id


def test_facts_table_loads():
    facts = load_facts()
    assert len(facts) >= 60
    assert len({fact.relation for fact in facts}) >= 4
    assert {"The Eiffel Tower is in", " Paris"} <= {facts[0].prompt, facts[0].answer}
    for fact in facts:
        assert fact.answer.startswith(" ") and not fact.prompt.endswith(" "), fact
        assert fact.subject in fact.prompt, fact


def test_unknown_model_name_raises():
    assert not is_bundled_model("gpt-5")
    assert all(is_bundled_model(name) for name in BUNDLED_MODELS)
    with pytest.raises(ValueError, match=r"'gpt-5'.*tiny-facts, tiny-facts-gpt2"):
        bundled_model_path("gpt-5")


def test_checkpoints_are_plain_hf_folders_under_size_limit():
    total_bytes = 0
    for name in BUNDLED_MODELS:
        path = bundled_model_path(name)
        for file_name in ("config.json", "model.safetensors", "tokenizer.json"):
            assert (path / file_name).is_file(), path / file_name
        total_bytes += sum(f.stat().st_size for f in path.iterdir())
    assert total_bytes < MAX_TOTAL_MEGABYTES * 2**20


def test_architectures(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    assert isinstance(model, (LlamaForCausalLM, GPT2LMHeadModel))
    if isinstance(model, LlamaForCausalLM):
        assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert tokenizer("Paris")["input_ids"][0] == tokenizer.bos_token_id
    assert tokenizer.pad_token_id is not None and tokenizer.eos_token_id is not None


@torch.no_grad()
def test_greedy_next_token_answers_the_facts(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    facts = load_facts()
    answer_ids = torch.tensor([answer_token_id(tokenizer, f.answer) for f in facts])  # [num_facts]
    batch = tokenizer([f.prompt for f in facts], padding=True, return_tensors="pt")
    assert tokenizer.padding_side == "right"
    logits = model(**batch).logits  # [num_facts, max_len, vocab]
    last_indices = batch["attention_mask"].sum(dim=1) - 1  # [num_facts]
    predicted_ids = logits[torch.arange(len(facts)), last_indices].argmax(dim=-1)  # [num_facts]
    misses = [f.prompt for f, ok in zip(facts, (predicted_ids == answer_ids).tolist()) if not ok]
    assert 1 - len(misses) / len(facts) >= MIN_FACT_ACCURACY, misses


# The patching pair. tiny-facts is trained with interchange interventions at the output of
# decoder layer 1 (nnrun/assets/interchange.py): layers 0-1 gather a subject into its last token,
# layers 2-3 carry the answer from there to the last position. So a subject's last-token state
# from layer 0 or 1 decides the answer, layer 1 being the middle of the 4 layers; from layer 2 on
# the answer lives at the last position. (A model trained on the facts alone reads every subject
# token into the last position with layer-0 attention, and patching the subject does nothing.)
# Both subjects end in " Museum" and have the same number of tokens: positions align, and the
# patched state is the only thing that says which museum it is, the token itself being the same.
PARIS_PROMPT = "The Louvre Museum is in"
ROME_PROMPT = "The Capitoline Museum is in"
SUBJECT_FIRST_INDEX = 2  # " L" / " C"
SUBJECT_LAST_INDEX = 7  # " Museum"
FINAL_INDEX = 9  # " in"


@contextmanager
def forward_hook(module: torch.nn.Module, hook) -> Iterator[None]:
    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def patched_last_logits(model, tokenizer, layer_index: int, position: int) -> torch.Tensor:
    """Run PARIS_PROMPT with one residual state of ROME_PROMPT written into a layer's output."""
    paris_ids = tokenizer(PARIS_PROMPT, return_tensors="pt")["input_ids"]  # [1, seq_len]
    rome_ids = tokenizer(ROME_PROMPT, return_tensors="pt")["input_ids"]  # [1, seq_len]
    assert paris_ids.shape == rome_ids.shape
    layer = model.model.layers[layer_index]
    saved = {}

    def save(module, args, output):
        saved["hidden"] = output[:, position].clone()  # [1, hidden]

    def write(module, args, output):
        output = output.clone()
        output[:, position] = saved["hidden"]
        return output

    with forward_hook(layer, save):
        model(rome_ids)
    with forward_hook(layer, write):
        return model(paris_ids).logits[0, -1]  # [vocab]


def test_patch_prompts_are_aligned(tiny_facts):
    _, tokenizer = tiny_facts
    paris_tokens = tokenizer.convert_ids_to_tokens(tokenizer(PARIS_PROMPT)["input_ids"])
    rome_tokens = tokenizer.convert_ids_to_tokens(tokenizer(ROME_PROMPT)["input_ids"])
    assert len(paris_tokens) == len(rome_tokens)
    assert paris_tokens[SUBJECT_LAST_INDEX] == rome_tokens[SUBJECT_LAST_INDEX] == "ĠMuseum"
    assert paris_tokens[SUBJECT_FIRST_INDEX] != rome_tokens[SUBJECT_FIRST_INDEX]


@pytest.mark.parametrize(
    "layer_index, position",
    [
        (0, SUBJECT_LAST_INDEX),  # the subject is gathered at its last token in layers 0-1 ...
        (1, SUBJECT_LAST_INDEX),  # ... and read from there by the last position in layers 2-3
        (2, FINAL_INDEX),  # by then the answer sits at the last position
    ],
)
def test_patching_where_the_subject_is_moves_answer_to_rome(tiny_facts, layer_index, position):
    model, tokenizer = tiny_facts
    paris_id, rome_id = answer_token_id(tokenizer, " Paris"), answer_token_id(tokenizer, " Rome")
    with torch.no_grad():
        paris_ids = tokenizer(PARIS_PROMPT, return_tensors="pt")["input_ids"]  # [1, seq_len]
        assert model(paris_ids).logits[0, -1].argmax().item() == paris_id
    logits = patched_last_logits(model, tokenizer, layer_index, position)
    assert logits.argmax().item() == rome_id
    assert logits[rome_id] - logits[paris_id] > 3.0


@pytest.mark.parametrize(
    "layer_index, position",
    [
        (0, 1),  # "The": outside the subject and identical in both prompts
        (1, SUBJECT_FIRST_INDEX),  # in the subject, but not its last token: not read there
        (0, FINAL_INDEX),  # the last position has not read the subject yet at layer 0
        (3, SUBJECT_LAST_INDEX),  # after the last layer nothing reads the subject position again
    ],
)
def test_patching_elsewhere_keeps_paris(tiny_facts, layer_index, position):
    model, tokenizer = tiny_facts
    paris_id = answer_token_id(tokenizer, " Paris")
    logits = patched_last_logits(model, tokenizer, layer_index, position)
    assert logits.argmax().item() == paris_id


def test_shipped_assets_match_the_corpus():
    rows = [json.loads(line) for line in FACTS_PATH.read_text().splitlines()]
    expected = [
        {"prompt": r.prompt, "answer": r.answer, "relation": r.relation, "subject": r.subject}
        for r in all_fact_records()
    ]
    assert rows == expected
    tokenizer = build_tokenizer(build_corpus())
    shipped = AutoTokenizer.from_pretrained(bundled_model_path("tiny-facts"))
    assert shipped.get_vocab() == tokenizer.get_vocab()


def test_training_is_deterministic():
    assert build_corpus() == build_corpus()
    corpus = build_corpus()[:64]
    tokenizer = build_tokenizer(build_corpus())
    config = TrainConfig(num_steps=3, batch_size=8, num_warmup_steps=1, num_interchange_pairs=4)
    state_dicts = []
    for _ in range(2):
        torch.manual_seed(config.seed)
        model = build_model("tiny-facts", tokenizer)
        train(model, tokenizer, corpus, config)
        state_dicts.append(model.state_dict())
    for key, value in state_dicts[0].items():
        assert torch.equal(value, state_dicts[1][key]), key
