"""Interchange-intervention training (Geiger et al., 2022) that localises subjects in tiny-facts.

Trained on templated facts alone, a 4-layer model reads every subject token into the last
position with layer-0 attention and looks the answer up there; no later position ever reads
the subject's own residual stream, so patching it does nothing. Large models instead gather
a multi-token subject at its last token and enrich it there ("subject enrichment"), which is
what causal-tracing demos show. To give tiny-facts that known mechanism, each training step
also runs pairs (base, source) of prompts with the same relation: the output of decoder layer
INTERCHANGE_LAYER at the source's last subject token replaces the base's at its own last
subject token, and the base must then predict the source's answer. Plain HF forward hooks do
the swap; the saved model is an ordinary LlamaForCausalLM.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from nnrun.assets.batching import collate, last_token_logits
from nnrun.assets.corpus import TemplatePrompt

# Output of decoder layer 1 of 4: layers 0-1 gather the subject at its last token, layers 2-3
# carry the answer to the last position.
INTERCHANGE_LAYER = 1


@dataclass(frozen=True)
class EncodedPrompts:
    """Fact prompts as token ids with the position of each subject's last token."""

    input_ids: list[list[int]]  # BOS + prompt tokens
    subject_last_indices: list[int]
    answer_ids: list[int]
    relations: list[str]

    def same_relation_other_answer(self) -> list[list[int]]:
        """row -> the rows of the same relation whose answer differs (the swap partners)."""
        return [
            [
                j
                for j in range(len(self.relations))
                if self.relations[j] == self.relations[i] and self.answer_ids[j] != self.answer_ids[i]
            ]
            for i in range(len(self.relations))
        ]


def encode_prompts(
    prompts: list[TemplatePrompt],
    tokenizer: PreTrainedTokenizerFast,
) -> EncodedPrompts:
    """Tokenize prompts (BOS added) and locate the subject's last token in each."""
    input_ids, subject_last_indices, answer_ids = [], [], []
    for prompt in prompts:
        ids = tokenizer(prompt.text)["input_ids"]
        head_ids = tokenizer(prompt.text[: prompt.subject_end])["input_ids"]
        # Byte-level pre-tokenization splits at the word boundary ending the subject, so the
        # prompt's tokens start with exactly the subject-prefix's tokens.
        assert ids[: len(head_ids)] == head_ids, prompt
        input_ids.append(ids)
        subject_last_indices.append(len(head_ids) - 1)
        (answer_id,) = tokenizer(" " + prompt.answer_word, add_special_tokens=False)["input_ids"]
        answer_ids.append(answer_id)
    relations = [prompt.relation for prompt in prompts]
    return EncodedPrompts(input_ids, subject_last_indices, answer_ids, relations)


def sample_pairs(
    partners: list[list[int]],
    num_pairs: int,
    generator: torch.Generator,
) -> tuple[list[int], list[int]]:
    """Random (base, source) rows: same relation, different answers."""
    base_rows = torch.randint(len(partners), (num_pairs,), generator=generator).tolist()
    source_rows = [
        partners[row][int(torch.randint(len(partners[row]), (1,), generator=generator))] for row in base_rows
    ]
    return base_rows, source_rows


class _StopForward(Exception):
    """Raised by the capture hook: the source run needs nothing past the interchange layer."""


@contextmanager
def _forward_hook(module: torch.nn.Module, hook: Callable) -> Iterator[None]:
    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def interchange_loss(
    model: PreTrainedModel,
    prompts: EncodedPrompts,
    base_rows: list[int],
    source_rows: list[int],
    pad_id: int,
    layer_index: int = INTERCHANGE_LAYER,
) -> torch.Tensor:
    """Cross-entropy of the source answers after swapping in the source subjects' states."""
    layer = model.model.layers[layer_index]
    rows = torch.arange(len(base_rows))
    source = collate([prompts.input_ids[r] for r in source_rows], pad_id)
    source_loc = torch.tensor([prompts.subject_last_indices[r] for r in source_rows])  # [num_pairs]
    captured: dict[str, torch.Tensor] = {}

    def capture(module, args, output):
        captured["states"] = output[rows, source_loc]  # [num_pairs, hidden]
        raise _StopForward

    with _forward_hook(layer, capture):
        try:
            model(input_ids=source["input_ids"], attention_mask=source["attention_mask"])
        except _StopForward:
            pass

    base = collate([prompts.input_ids[r] for r in base_rows], pad_id)
    base_loc = torch.tensor([prompts.subject_last_indices[r] for r in base_rows])  # [num_pairs]

    def patch(module, args, output):
        output = output.clone()
        output[rows, base_loc] = captured["states"]
        return output

    with _forward_hook(layer, patch):
        logits = model(input_ids=base["input_ids"], attention_mask=base["attention_mask"]).logits
    final_logits = last_token_logits(logits, base["attention_mask"])  # [num_pairs, vocab]
    target_ids = torch.tensor([prompts.answer_ids[r] for r in source_rows])  # [num_pairs]
    return F.cross_entropy(final_logits, target_ids)
