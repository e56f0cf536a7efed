"""The nnsight bridge: nnsight's model API on nnrun's packed, continuously batched engine."""

from interleaver.model import LanguageModel
from interleaver.runner import NNsightGPUModelRunner

__all__ = ["LanguageModel", "NNsightGPUModelRunner"]
