"""Train the bundled tiny models on the synthetic facts corpus.

    python -m nnrun.assets.train_tiny [--out DIR] [--model tiny-facts|tiny-facts-gpt2|all]

Writes DIR/<model>/ (an HF checkpoint folder with the shared tokenizer) and DIR/facts.jsonl.
Both models learn the corpus with the language-model loss; tiny-facts also learns interchange
interventions (interchange.py) so that its subjects are localised at their last token. Training
is seeded and runs on CPU with deterministic algorithms and a fixed thread count, so two runs on
the same torch build give the same weights.
"""

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from nnrun.assets.batching import collate, last_token_logits
from nnrun.assets.corpus import all_fact_records, all_template_prompts, answer_words, build_corpus
from nnrun.assets.interchange import encode_prompts, interchange_loss, sample_pairs

ASSETS_DIR = Path(__file__).resolve().parent
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|pad|>", "<|bos|>", "<|eos|>"
VOCAB_SIZE = 768
# Extra copies of the answer words fed to the BPE trainer, so each " word" ends up one token
# however rare it is in the corpus (checked after training).
NUM_ANSWER_BOOST_LINES = 20
MAX_POSITIONS = 128
NUM_THREADS = 1


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings of one model."""

    num_steps: int
    batch_size: int = 64
    num_interchange_pairs: int = 0  # per step; 0 trains on the language-model loss alone
    learning_rate: float = 3e-3
    num_warmup_steps: int = 50
    weight_decay: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_steps <= self.num_warmup_steps:
            raise ValueError(f"num_steps ({self.num_steps}) must exceed num_warmup_steps")
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
        if self.num_interchange_pairs < 0:
            raise ValueError(f"num_interchange_pairs must be >= 0, got {self.num_interchange_pairs}")


MODEL_TO_TRAIN_CONFIG = {
    "tiny-facts": TrainConfig(num_steps=500, batch_size=48, num_interchange_pairs=32),
    "tiny-facts-gpt2": TrainConfig(num_steps=600),
}


def build_tokenizer(corpus: list[str]) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer that prepends BOS and keeps every answer one token."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    answer_line = "".join(" " + word for word in answer_words())
    tokenizer.train_from_iterator(corpus + [answer_line] * NUM_ANSWER_BOOST_LINES, trainer)
    split_answers = [w for w in answer_words() if len(tokenizer.encode(" " + w).ids) != 1]
    if split_answers:
        raise ValueError(f"answer words not single tokens: {split_answers}")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, tokenizer.token_to_id(BOS_TOKEN))],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=MAX_POSITIONS,
        padding_side="right",
    )


def build_model(name: str, tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    """A freshly initialised tiny-facts (Llama, GQA) or tiny-facts-gpt2 model."""
    special_ids = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if name == "tiny-facts":
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=192,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=MAX_POSITIONS,
            tie_word_embeddings=True,
            **special_ids,
        )
        return LlamaForCausalLM(config)
    if name == "tiny-facts-gpt2":
        config = GPT2Config(
            vocab_size=len(tokenizer),
            n_embd=192,
            n_layer=4,
            n_head=4,
            n_positions=MAX_POSITIONS,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=True,
            **special_ids,
        )
        return GPT2LMHeadModel(config)
    raise ValueError(f"unknown model name {name!r}")


def train(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, corpus: list[str], config: TrainConfig) -> None:
    """Seeded AdamW with linear warmup and cosine decay over shuffled epochs of the corpus."""
    generator = torch.Generator().manual_seed(config.seed)
    sequences = [tokenizer(s)["input_ids"] + [tokenizer.eos_token_id] for s in corpus]
    prompts = encode_prompts(all_template_prompts(), tokenizer)
    partners = prompts.same_relation_other_answer()
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=config.learning_rate,
        weight_decay=config.weight_decay,
        betas=(0.9, 0.98),
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_scale(step, config))
    model.train()
    order: list[int] = []
    for step in range(config.num_steps):
        if len(order) < config.batch_size:
            order += torch.randperm(len(sequences), generator=generator).tolist()
        batch_indices, order = order[: config.batch_size], order[config.batch_size :]
        loss = model(**collate([sequences[i] for i in batch_indices], tokenizer.pad_token_id)).loss
        if config.num_interchange_pairs:
            base_rows, source_rows = sample_pairs(partners, config.num_interchange_pairs, generator)
            loss = loss + interchange_loss(model, prompts, base_rows, source_rows, tokenizer.pad_token_id)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == config.num_steps - 1:
            print(f"  step {step:5d}  loss {loss.item():.4f}", flush=True)
    model.eval()


def _lr_scale(step: int, config: TrainConfig) -> float:
    # Linear warmup, then cosine decay to 5% of the peak learning rate.
    if step < config.num_warmup_steps:
        return (step + 1) / config.num_warmup_steps
    progress = (step - config.num_warmup_steps) / (config.num_steps - config.num_warmup_steps)
    return 0.05 + 0.95 * 0.5 * (1.0 + math.cos(progress * math.pi))


@torch.no_grad()
def fact_accuracy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> float:
    """Fraction of canonical fact prompts whose greedy next token is the expected answer."""
    records = all_fact_records()
    batch = collate([tokenizer(r.prompt)["input_ids"] for r in records], tokenizer.pad_token_id)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    predicted_ids = last_token_logits(logits, batch["attention_mask"]).argmax(dim=-1)  # [num_facts]
    answer_ids = [tokenizer(r.answer, add_special_tokens=False)["input_ids"][0] for r in records]
    return (predicted_ids == torch.tensor(answer_ids)).float().mean().item()


def write_facts_table(path: Path) -> None:
    """The canonical prompt and answer of every fact, one JSON object a line."""
    with path.open("w") as f:
        for record in all_fact_records():
            row = {
                "prompt": record.prompt,
                "answer": record.answer,
                "relation": record.relation,
                "subject": record.subject,
            }
            f.write(json.dumps(row) + "\n")


def train_and_save(name: str, out_dir: Path) -> None:
    """Build the tokenizer and model from scratch, train, check accuracy and save."""
    config = MODEL_TO_TRAIN_CONFIG[name]
    torch.manual_seed(config.seed)
    corpus = build_corpus()
    tokenizer = build_tokenizer(corpus)
    model = build_model(name, tokenizer)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{name}: {num_params / 1e6:.2f}M params, {len(corpus)} sentences", flush=True)
    start = time.perf_counter()
    train(model, tokenizer, corpus, config)
    accuracy = fact_accuracy(model, tokenizer)
    print(f"{name}: trained in {time.perf_counter() - start:.0f}s, fact accuracy {accuracy:.3f}")
    model.save_pretrained(out_dir / name)
    tokenizer.save_pretrained(out_dir / name)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ASSETS_DIR)
    parser.add_argument("--model", choices=[*MODEL_TO_TRAIN_CONFIG, "all"], default="all")
    args = parser.parse_args(argv)
    torch.set_num_threads(NUM_THREADS)
    torch.use_deterministic_algorithms(True)
    args.out.mkdir(parents=True, exist_ok=True)
    names = list(MODEL_TO_TRAIN_CONFIG) if args.model == "all" else [args.model]
    for name in names:
        train_and_save(name, args.out)
    write_facts_table(args.out / "facts.jsonl")


if __name__ == "__main__":
    main()
