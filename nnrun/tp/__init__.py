"""Tensor parallelism: one front end (scheduler, sampler, callers) driving N rank processes that hold the shards."""

from nnrun.tp.group import TensorParallelError
from nnrun.tp.plan import check_tensor_parallel_plan
from nnrun.tp.runner import TensorParallelRunner, tensor_parallel_runner_class

__all__ = ["TensorParallelError", "TensorParallelRunner", "check_tensor_parallel_plan", "tensor_parallel_runner_class"]
