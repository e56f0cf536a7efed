"""Engine configuration dataclasses, each validated where it is built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """`None`/"auto" means float32 on CPU and bfloat16 on CUDA."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of float32, float16, bfloat16, got {dtype}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(set(_DTYPES))} or 'auto', got {dtype!r}")
    return _DTYPES[dtype]


@dataclass
class ModelConfig:
    """What to load: an in-memory model, a checkpoint folder, a hub id or a bundled name."""

    model: Any
    tokenizer: Any = None
    load_format: str = "auto"  # "auto" or "dummy" (random weights from the config)
    max_model_len: int | None = None  # default: the model's own context length
    revision: str | None = None
    trust_remote_code: bool = False
    # "auto": the packed path if the load-time probe finds it gives HF's own numbers, else the exact
    # path (each request through HF's own forward and cache); "exact": the exact path, always.
    forward_path: str = "auto"

    def __post_init__(self) -> None:
        if self.model is None or (isinstance(self.model, str) and not self.model.strip()):
            raise ValueError("ModelConfig.model must name a model or be a PreTrainedModel, got nothing")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"ModelConfig.load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.forward_path not in ("auto", "exact"):
            raise ValueError(f"ModelConfig.forward_path must be 'auto' or 'exact', got {self.forward_path!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"ModelConfig.max_model_len must be positive, got {self.max_model_len}")


@dataclass
class CacheConfig:
    """Paged KV cache geometry; the pool holds `num_pages * page_size` token slots per layer."""

    page_size: int = 16
    num_pages: int | None = None  # None: sized from max_total_tokens or the device's free memory
    max_total_tokens: int | None = None  # KV capacity in tokens (rounded up to pages)
    gpu_memory_utilization: float = 0.9
    # Device memory the values of running traces may hold (left out of the KV pool); saves beyond it go to
    # host memory (pinned on CUDA). None: 5% of a CUDA card; on CPU, the host budget's size.
    saved_values_device_bytes: int | None = None
    # Host memory for saves beyond the device budget; a trace that needs more fails alone. None: half the RAM.
    saved_values_host_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"CacheConfig.page_size must be positive, got {self.page_size}")
        if self.num_pages is not None and self.num_pages <= 0:
            raise ValueError(f"CacheConfig.num_pages must be positive, got {self.num_pages}")
        if self.max_total_tokens is not None and self.max_total_tokens <= 0:
            raise ValueError(f"CacheConfig.max_total_tokens must be positive, got {self.max_total_tokens}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"CacheConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("saved_values_device_bytes", "saved_values_host_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"CacheConfig.{name} must be a number of bytes >= 0 or None, got {value!r}")


@dataclass
class SchedulerConfig:
    """Admission limits of one engine step."""

    max_num_seqs: int = 256  # requests running at once
    max_num_batched_tokens: int = 8192  # new tokens in one forward (a longer prompt runs alone)
    # vLLM's name: decode steps run per scheduling decision when no request needs the host between them
    # (nnrun/multi_step.py); 1 schedules every step. None: 1 for now (4 on CUDA once a GPU session has checked
    # windows there; on CPU a window gains nothing measurable: benchmarks/step_overhead.py).
    num_scheduler_steps: int | None = None

    def __post_init__(self) -> None:
        steps = self.num_scheduler_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0):
            raise ValueError(f"SchedulerConfig.num_scheduler_steps must be a positive integer or None, got {steps!r}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"SchedulerConfig.max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"SchedulerConfig.max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )


@dataclass
class DeviceConfig:
    """Where the model runs and in which dtype."""

    device: str = "cpu"
    dtype: str | torch.dtype | None = None
    attention_backend: str = "auto"  # "auto", "torch" or "flashinfer"
    # Decode steps with no hooks or interventions replay decode graphs: CUDA graphs, or on CPU the step's ops traced,
    # attention included where the backend gives it as ops (nnrun/traced_graph.py, each size captured at its 4th step)
    enable_cuda_graphs: bool = True
    cuda_graph_batch_sizes: list[int] | None = None  # None: 1, 2, 4, 8, 16, 32, ... up to max_num_seqs (256 at most)
    # Decode steps that blocks watch replay per-layer graphs around the watched layers (`graph_pieces.py`);
    # off, such steps run eagerly. None: on wherever decode graphs are (CUDA's, checked on an H200, docs/gpu.md;
    # the CPU's traced pieces, each size captured lazily as its whole-step graph is, docs/benchmarks.md).
    cuda_graph_pieces: bool | None = None
    # The captured decode graphs run the decoder layers torch.compile'd (inductor fuses HF's elementwise ops);
    # eager steps keep HF's modules (nnrun/compiled_layers.py). Off: compiling costs start-up time.
    compile_decoder_layers: bool = False
    torch_dtype: torch.dtype = field(init=False)

    def graph_pieces_on(self) -> bool:
        """`cuda_graph_pieces`, or its default: on with any device's decode graphs."""
        return self.cuda_graph_pieces is not False

    def __post_init__(self) -> None:
        device = str(self.device)
        if not (device == "cpu" or device.startswith("cuda") or device == "mps"):
            raise ValueError(f"DeviceConfig.device must be 'cpu', 'cuda[:N]' or 'mps', got {self.device!r}")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"DeviceConfig.device is {device!r} but CUDA is not available on this machine")
        if self.attention_backend not in ("auto", "torch", "flashinfer"):
            raise ValueError(
                f"DeviceConfig.attention_backend must be 'auto', 'torch' or 'flashinfer', got {self.attention_backend!r}"
            )
        if self.cuda_graph_batch_sizes is not None:
            sizes = list(self.cuda_graph_batch_sizes)
            if not sizes or not all(isinstance(n, int) and n > 0 for n in sizes):
                raise ValueError(f"DeviceConfig.cuda_graph_batch_sizes must be positive integers, got {sizes!r}")
            self.cuda_graph_batch_sizes = sorted(set(sizes))
        self.device = device
        self.torch_dtype = resolve_dtype(self.dtype, device)


@dataclass
class ParallelConfig:
    """How many processes share the model: `tensor_parallel_size` ranks, each with a shard of every layer."""

    tensor_parallel_size: int = 1
    tensor_parallel_timeout: float = 300.0  # seconds a step or a collective may take before the group is declared hung
    # Decode CUDA graphs on the ranks (collectives captured inside). Opt-in: checked under a stand-in for
    # CUDA's capture on CPU and with one NCCL rank, never on several GPUs; ranks decode eagerly otherwise.
    tensor_parallel_cuda_graphs: bool = False

    def __post_init__(self) -> None:
        if (
            isinstance(self.tensor_parallel_size, bool)
            or not isinstance(self.tensor_parallel_size, int)
            or self.tensor_parallel_size <= 0
        ):
            raise ValueError(
                f"ParallelConfig.tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}"
            )
        if not self.tensor_parallel_timeout > 0:
            raise ValueError(
                f"ParallelConfig.tensor_parallel_timeout must be positive seconds, got {self.tensor_parallel_timeout!r}"
            )


@dataclass
class EngineConfig:
    """Everything the engine needs, grouped by concern."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @classmethod
    def from_kwargs(
        cls, model: Any, tokenizer: Any = None, device: str = "cpu", dtype: Any = None, **kwargs: Any
    ) -> "EngineConfig":
        """Route flat `LLM(...)` keywords to the config that owns them; unknown names are an error."""
        groups: dict[type, dict[str, Any]] = {
            ModelConfig: {},
            CacheConfig: {},
            SchedulerConfig: {},
            DeviceConfig: {},
            ParallelConfig: {},
        }
        for name, value in kwargs.items():
            owner = next(
                (c for c in groups if name in c.__dataclass_fields__ and c.__dataclass_fields__[name].init), None
            )
            if owner is None:
                raise ValueError(f"unknown engine option {name!r}")
            groups[owner][name] = value
        return cls(
            model=ModelConfig(model=model, tokenizer=tokenizer, **groups[ModelConfig]),
            cache=CacheConfig(**groups[CacheConfig]),
            scheduler=SchedulerConfig(**groups[SchedulerConfig]),
            device=DeviceConfig(device=device, dtype=dtype, **groups[DeviceConfig]),
            parallel=ParallelConfig(**groups[ParallelConfig]),
        )
