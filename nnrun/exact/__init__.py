"""The exact path: models the packed path cannot serve run through HF's own forward, one request at a time."""

from nnrun.exact.hf_forward import HFForward
from nnrun.exact.path import FORCED_REASON, choose_exact_forward, family_of, packed_layers
from nnrun.exact.probe import ModelRefusedError

__all__ = ["FORCED_REASON", "HFForward", "ModelRefusedError", "choose_exact_forward", "family_of", "packed_layers"]
