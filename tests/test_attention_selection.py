"""Which attention backend an engine gets: FlashInfer's kernels exist only for some head dims.

Seen on an H100: a head dim of 48 JIT-compiles and then fails at run time with "Invalid
configuration", so "auto" must not pick FlashInfer for it and an explicit request must say why.
"""

from types import SimpleNamespace

import pytest
import torch

from nnrun.attention import selection
from nnrun.memory import LayerKVShape
from nnrun.model_probe import AttentionLayerInfo


def _layers(head_dim: int) -> list[AttentionLayerInfo]:
    shape = LayerKVShape(num_kv_heads=2, head_dim=head_dim, v_head_dim=head_dim)
    return [
        AttentionLayerInfo(
            layer_idx=i, num_q_heads=4, kv_shape=shape, scaling=head_dim**-0.5, sliding_window=None, softcap=None
        )
        for i in range(2)
    ]


def _bf16_pool():
    return SimpleNamespace(k_pages=[torch.empty(0, dtype=torch.bfloat16)])


def test_explicit_flashinfer_with_an_unsupported_head_dim_names_it():
    with pytest.raises(ValueError, match=r"head dims \(64, 128, 256\).*\[48\]"):
        selection.create_attention_backend("flashinfer", _bf16_pool(), torch.device("cuda"), _layers(48))


def test_auto_on_cuda_keeps_the_torch_backend_for_an_unsupported_head_dim(monkeypatch):
    monkeypatch.setattr(selection, "_flashinfer_available", lambda: True)
    built = []
    monkeypatch.setattr(selection, "TorchAttnBackend", lambda pool, device: built.append(device) or "torch")
    assert selection.create_attention_backend("auto", _bf16_pool(), torch.device("cuda"), _layers(48)) == "torch"
    assert built == [torch.device("cuda")]


def test_auto_on_cuda_takes_flashinfer_for_a_supported_head_dim(monkeypatch):
    import nnrun.attention.flashinfer_backend as flashinfer_backend

    monkeypatch.setattr(selection, "_flashinfer_available", lambda: True)
    monkeypatch.setattr(flashinfer_backend, "FlashInferAttnBackend", lambda pool, device, layers: "flashinfer")
    assert selection.create_attention_backend("auto", _bf16_pool(), torch.device("cuda"), _layers(64)) == "flashinfer"
