"""What the distributed tests share: the job, its input and how folders are compared."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

MODEL = "tiny-facts"
MODULES = ["model.layers.1", "model.layers.2.mlp.input"]
WORDS = (
    "the cat sat on a mat while dogs ran in parks near paris and rome where people eat bread "
    "with cheese before going to work at the museum of art every day"
).split()
# Small shards and forward batches: many ranges, each several forwards long, so a kill lands mid-range.
JOB = {
    "shard_tokens": 600,
    "llm_kwargs": {"device": "cpu", "max_num_batched_tokens": 96},
    "progress": False,
    "on_error": "skip",
}
BAD_LINES = (45, 200)  # empty lines of the input file: skipped items recorded in the manifest
NUM_THREADS = 1  # CPU float results depend on torch's thread count; each engine uses 1 (RayExecutor default)


def job_prompts(count: int = 320, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) for _ in range(count)]


def folder_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file of a folder, by name."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(folder).iterdir())}
