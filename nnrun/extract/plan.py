"""Deterministic layout of a job: which input records form each shard, and each forward batch.

Resume is byte-identical because the layout depends only on the records: a shard is closed
before the first prompt that would take it past `shard_tokens`, the next shard starts at that
record, and forward batches are cut greedily from a shard's own prompts. A resumed job starts
at the record after the last complete shard, exactly where the uninterrupted job started the
next shard, and from there makes the same shards out of the same forward batches.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from nnrun.extract.identity import InputHasher
from nnrun.extract.inputs import PromptRecord
from nnrun.extract.prepare import PreparedPrompt, SkippedPrompt


@dataclass
class ShardPlan:
    """The records from the previous shard's end up to `end`: prompts to extract and items skipped."""

    prompts: list[PreparedPrompt] = field(default_factory=list)
    skipped: list[SkippedPrompt] = field(default_factory=list)
    end: int = 0  # records consumed once this shard is committed

    @property
    def num_tokens(self) -> int:
        return sum(p.num_tokens for p in self.prompts)


def plan_shards(items: Iterable[PreparedPrompt | SkippedPrompt], shard_tokens: int, start: int) -> Iterator[ShardPlan]:
    """Group prompts into shards of at most `shard_tokens` tokens (a longer prompt gets a shard alone).

    The last plan may hold only skipped items, or nothing at all.
    """
    if shard_tokens <= 0:
        raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
    plan, num_tokens, end = ShardPlan(end=start), 0, start
    for item in items:
        if isinstance(item, SkippedPrompt):
            plan.skipped.append(item)
        else:
            if plan.prompts and num_tokens + item.num_tokens > shard_tokens:
                plan.end = item.index
                yield plan
                plan, num_tokens = ShardPlan(), 0
            plan.prompts.append(item)
            num_tokens += item.num_tokens
        end = item.index + 1
    plan.end = end
    yield plan


def forward_batches(
    prompts: list[PreparedPrompt], max_tokens: int, max_prompts: int, page_size: int = 1
) -> Iterator[list[PreparedPrompt]]:
    """Consecutive prompts under a token and a count budget (a longer prompt runs alone).

    A prompt counts as its KV footprint, whole pages (`ceil(n / page_size) * page_size`), so a
    batch within `max_tokens` also fits a KV pool of `max_tokens` slots.
    """
    batch: list[PreparedPrompt] = []
    num_tokens = 0
    for prompt in prompts:
        cost = -(-prompt.num_tokens // page_size) * page_size
        if batch and (num_tokens + cost > max_tokens or len(batch) == max_prompts):
            yield batch
            batch, num_tokens = [], 0
        batch.append(prompt)
        num_tokens += cost
    if batch:
        yield batch


class HashedRecords:
    """Pass records through, hashing them in order; `commit(n)` folds the first n into the digest.

    Records are read ahead of the shard being built (the tokenizer works in chunks), so the
    digest saved with a shard must cover exactly the records that shard consumed: read records
    wait in a queue until a commit reaches them.
    """

    def __init__(self, records: Iterable[PromptRecord], hasher: InputHasher | None = None) -> None:
        self._records = iter(records)
        self._pending: deque[PromptRecord] = deque()
        # A resume that starts at record n passes the hasher that has seen the n records before it.
        self.hasher = hasher if hasher is not None else InputHasher()

    def __iter__(self) -> Iterator[PromptRecord]:
        for record in self._records:
            self._pending.append(record)
            yield record

    def skip(self, count: int) -> bool:
        """Consume and commit the first `count` records (a resume); False if the input is shorter."""
        while self.hasher.num_records < count:
            record = next(self._records, None)
            if record is None:
                return False
            self.hasher.update(record.prompt, record.error)
        return True

    def commit(self, count: int) -> str:
        """Fold records up to `count` into the digest; return the digest."""
        while self.hasher.num_records < count:
            record = self._pending.popleft()
            self.hasher.update(record.prompt, record.error)
        return self.hasher.hexdigest()
