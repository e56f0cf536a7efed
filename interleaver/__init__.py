"""The nnsight bridge: nnsight's model API on nnrun's packed, continuously batched engine."""

from interleaver.model import LanguageModel, TransformersModel
from interleaver.runner import NNsightGPUModelRunner
from interleaver.vllm import VLLM

__all__ = ["LanguageModel", "NNsightGPUModelRunner", "TransformersModel", "VLLM"]
