"""What travels, without a server: the raw-tensor answer format and the client's cached block payload.

The oracles are `torch.save`/`torch.load` (the format nnsight's own client reads) and nnsight's
`reduce_block` (what `RequestModel.serialize` ships for a block).
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch

from nnsight.intervention.serialization import reduce_block

from nnrun.serve import block_payload, tensor_pickle, transport, wire


def _torch_round_trip(payload):
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)


@pytest.mark.parametrize(
    "value",
    [
        torch.randn(2, 5, 7),
        torch.randn(4, 6).bfloat16().t(),  # non-contiguous, no numpy dtype
        torch.randn(3, 4)[:, 1],  # a view into a larger storage: only its own elements travel
        torch.arange(10),
        torch.tensor([True, False, True]),
        torch.randn(3, dtype=torch.complex64),
        torch.tensor(2.5, dtype=torch.float16),  # 0-dim
        torch.zeros(0, 3),
        torch.randn(4, 6).t(),  # non-contiguous, through numpy's strides
        torch.randn(3, 1).expand(3, 4),  # a zero stride: every row travels
    ],
    ids=["f32", "bf16-transposed", "view", "int64", "bool", "complex", "0-dim", "empty", "f32-transposed", "expanded"],
)
def test_raw_tensor_answers_equal_torch_save_ones(value):
    saves = {"hidden": value, "nested": [value * 2, {"x": value.clone()}], "n": 3}
    body = wire.encode_result(saves, None, [{"steer": {"h": value + 1}}], raw_tensors=True)
    assert body.startswith(tensor_pickle.MAGIC)
    got = wire.decode_result(body)
    expected = _torch_round_trip({"saves": saves, "registered": [{"steer": {"h": value + 1}}]})
    for ours, theirs in [
        (got["saves"]["hidden"], expected["saves"]["hidden"]),
        (got["saves"]["nested"][0], expected["saves"]["nested"][0]),
        (got["saves"]["nested"][1]["x"], expected["saves"]["nested"][1]["x"]),
        (got["registered"][0]["steer"]["h"], expected["registered"][0]["steer"]["h"]),
    ]:
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        assert torch.equal(ours, theirs)
    assert got["saves"]["n"] == 3 and got["error"] is None
    hidden = got["saves"]["hidden"]
    hidden.zero_()  # writable, as a torch.load'ed tensor is
    assert not hidden.any()


def test_what_raw_bytes_would_not_carry_goes_through_torch_save():
    base = torch.randn(3, 4)
    cases = {
        "a tensor and a view of it": {"h": base, "last": base[:, -1]},
        "a tensor that requires grad": {"h": torch.randn(3, requires_grad=True)},
        "a Parameter": {"p": torch.nn.Parameter(torch.randn(2))},
        "a conjugate view": {"c": torch.randn(3, dtype=torch.complex64).conj()},
        "a negative view": {"n": torch.randn(3, dtype=torch.complex64).conj().imag},
    }
    for name, saves in cases.items():
        body = wire.encode_result(saves, None, raw_tensors=True)
        assert body.startswith(b"PK"), name  # torch.save's zip
        assert set(wire.decode_result(body)["saves"]) == set(saves)
    shared = wire.decode_result(wire.encode_result(cases["a tensor and a view of it"], None, raw_tensors=True))["saves"]
    shared["h"][0, -1] = 100.0
    assert shared["last"][0] == 100.0  # still one storage, as torch.save keeps it
    grad = wire.decode_result(wire.encode_result(cases["a tensor that requires grad"], None, raw_tensors=True))
    assert grad["saves"]["h"].requires_grad
    for name in ("a conjugate view", "a negative view"):  # their values, not their storages' raw bytes
        ((key, value),) = cases[name].items()
        got = wire.decode_result(wire.encode_result(cases[name], None, raw_tensors=True))["saves"][key]
        assert torch.equal(got.resolve_conj().resolve_neg(), value.resolve_conj().resolve_neg()), name


def test_nnsights_format_unless_asked():
    body = wire.encode_result({"h": torch.ones(2)}, None)
    assert body.startswith(b"PK")
    assert torch.equal(torch.load(io.BytesIO(body), weights_only=False)["saves"]["h"], torch.ones(2))


def test_the_client_payload_is_nnsights_with_the_block_read_once(monkeypatch):
    import nnrun

    shipped, expected = [], []

    def dumps(obj):  # nnsight's own reduction of the same block and frame, next to what is shipped
        frame = obj[0].info.frame
        expected.append(reduce_block(obj[0].node, frame.f_globals, dict(frame.f_locals)))
        shipped.append(obj)
        return b""

    monkeypatch.setattr(block_payload, "dumps", dumps)
    monkeypatch.setattr(
        transport.Connection,
        "post",
        lambda self, path, content, params=None: wire.encode_result({}, None, raw_tensors=True),
    )
    read = []
    real_reduce = block_payload.reduce_block
    monkeypatch.setattr(block_payload, "reduce_block", lambda *args: read.append(1) or real_reduce(*args))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = nnrun.LanguageModel("tiny-facts", serve="http://127.0.0.1:9")  # never contacted
    for layer, scale in [(0, 1.0), (2, -3.0)]:
        vector = torch.full((4,), scale)
        with model.trace("The Eiffel Tower is in"):
            model.model.layers[layer].output[0, -1, :4] += vector
            hidden = model.model.layers[layer].output.save()  # noqa: F841 (a saved name the client pushes back)
    assert len(read) == 1  # the second trace of the same block reused its source and names
    for (sent_tracer, (source, used_globals, used_locals)), (nn_source, nn_globals, nn_locals) in zip(
        shipped, expected
    ):
        assert source == nn_source and used_globals == nn_globals
        assert used_locals.keys() == nn_locals.keys() and "vector" in used_locals and "layer" in used_locals
        assert torch.equal(used_locals["vector"], nn_locals["vector"]) and used_locals["layer"] == nn_locals["layer"]
    assert [shipped[i][1][2]["layer"] for i in range(2)] == [0, 2]  # each trace ships its own values
