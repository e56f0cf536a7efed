"""Where a request's values sit in one packed step: the three layouts, and a mediator's places in them.

nnrun runs the HF module tree on one flat batch `[1, N, ...]` that packs every scheduled request's
new tokens, and the set of requests changes every step. So a mediator's batch group is a
`PackedGroup`: for each of its member requests (one per prompt of its invoke, in invoke order) the
runner writes, every step, where that request sits in the three layouts a step produces:

- TOKENS  `[1, N, ...]`: every module of the forward (a prefill span, or one decode token);
- LOGITS  `[1, R, ...]`: the LM head and the model's output, which run on the `R` positions
  whose logits the step keeps (a traced prompt keeps all of them, a generation step one);
- ROWS    `[B, ...]`: per-request values after the forward (`model.logits`, `model.samples`).

Which layout a value is in comes from its location (`layout_of`), never from its shape.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

LOGITS_LOCATION = "model.logits"
SAMPLES_LOCATION = "model.samples"
ROOT_OUTPUT_LOCATION = "model.output"


class Layout(enum.Enum):
    TOKENS = "tokens"
    LOGITS = "logits"
    ROWS = "rows"


@dataclass
class PackedGroup:
    """Where one mediator's requests sit in this step, one entry per present member request."""

    token_spans: list[tuple[int, int]] = field(default_factory=list)  # (start, num_tokens) in [1, N]
    logit_spans: list[tuple[int, int]] = field(default_factory=list)  # (start, num_positions) in [1, R]
    rows: list[int] = field(default_factory=list)  # row in [B, ...]

    @property
    def is_single(self) -> bool:
        return len(self.rows) == 1

    def spans(self, layout: Layout) -> list[tuple[int, int]]:
        """The group's (start, length) spans in a token-packed layout (TOKENS or LOGITS)."""
        return self.token_spans if layout is Layout.TOKENS else self.logit_spans


def layout_of(location: str, lm_head_prefix: str | None) -> Layout:
    """The layout of the value served at `location` (`lm_head_prefix`: the LM head's path plus a dot)."""
    if location in (LOGITS_LOCATION, SAMPLES_LOCATION):
        return Layout.ROWS
    if location == ROOT_OUTPUT_LOCATION or (lm_head_prefix and location.startswith(lm_head_prefix)):
        return Layout.LOGITS
    return Layout.TOKENS


def module_of(location: str) -> str:
    """The module path of a location (`model.layers.0.output` -> `model.layers.0`), for messages."""
    for suffix in (".output", ".input", ".skip"):
        if location.endswith(suffix):
            return location[: -len(suffix)]
    return location
