"""Progress of an extraction job: a tqdm bar with prompts/s and tokens/s, and the final summary."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from tqdm import tqdm


@dataclass(frozen=True)
class ExtractionSummary:
    """What a call of `extract` did, and what the folder now holds."""

    out_dir: str
    num_prompts: int  # prompts stored in the folder
    num_tokens: int  # prompt tokens stored in the folder
    num_skipped: int  # input items left out (on_error="skip")
    num_shards: int
    num_resumed_shards: int  # complete shards found when this call started
    num_new_prompts: int  # extracted by this call
    num_new_tokens: int
    elapsed_s: float
    is_complete: bool

    @property
    def prompts_per_s(self) -> float:
        return self.num_new_prompts / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_new_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def line(self) -> str:
        """The one-line summary printed at the end of a job."""
        if self.num_new_prompts == 0 and self.num_skipped == 0 and self.is_complete and self.num_resumed_shards:
            return (
                f"nothing to do: {self.out_dir} is complete, {self.num_prompts} prompts, {self.num_tokens} tokens "
                f"in {self.num_shards} shards"
            )
        resumed = f", resumed after {self.num_resumed_shards} shards" if self.num_resumed_shards else ""
        skipped = f", {self.num_skipped} skipped" if self.num_skipped else ""
        return (
            f"extracted {self.num_new_prompts} prompts ({self.num_new_tokens} tokens) in {self.elapsed_s:.1f} s: "
            f"{self.prompts_per_s:.1f} prompts/s, {self.tokens_per_s:.0f} tokens/s{resumed}; "
            f"{self.out_dir} holds {self.num_prompts} prompts, {self.num_tokens} tokens in "
            f"{self.num_shards} shards{skipped}"
        )


class Progress:
    """A tqdm bar counting prompts with a tokens/s figure; silent when disabled."""

    def __init__(self, enabled: bool, total: int | None, initial: int = 0) -> None:
        self.enabled = enabled
        self.start = time.perf_counter()
        self.num_prompts = 0
        self.num_tokens = 0
        self._bar = (
            tqdm(total=total, initial=initial, unit="prompt", desc="extract", file=sys.stderr, dynamic_ncols=True)
            if enabled
            else None
        )

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start

    def update(self, num_prompts: int, num_tokens: int, num_skipped: int = 0) -> None:
        self.num_prompts += num_prompts
        self.num_tokens += num_tokens
        if self._bar is not None:
            self._bar.update(num_prompts + num_skipped)
            self._bar.set_postfix_str(f"{self.num_tokens / max(self.elapsed_s, 1e-9):.0f} tokens/s", refresh=False)

    def close(self, summary: ExtractionSummary | None = None) -> None:
        if self._bar is not None:
            self._bar.close()
            if summary is not None:
                print(summary.line(), file=sys.stderr)
