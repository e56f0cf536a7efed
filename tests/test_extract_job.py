"""Extraction jobs on the engine: values equal plain HF's, resume, refusals, bad input, write errors."""

import errno
import hashlib
import threading

import pytest
import torch

import nnrun
from model_zoo import make_model, make_twin, random_prompts
from nnrun.extract import InputError, SettingsMismatchError, ShardWriteError, extract, load_activations
from nnrun.extract.hooks import ActivationCapture, resolve_modules
from tolerance import assert_close_packed

LENGTHS = [1, 7, 33, 2, 64, 12, 5, 90, 3, 18]  # mixed, so packing and slicing are exercised
LLAMA_MODULES = [
    "model.embed_tokens",
    "model.layers.0",
    "model.layers.1.mlp",
    "model.layers.1.self_attn",
    "model.layers.1.self_attn.o_proj.input",
    "model.layers.0.mlp.down_proj.output",
    "model.norm",
]


@pytest.fixture(scope="module")
def llama():
    model = make_model("llama")
    llm = nnrun.LLM(model, max_num_batched_tokens=128)  # several forward batches per shard
    yield llm, make_twin(model)
    llm.shutdown()


@torch.no_grad()
def hf_values(twin: torch.nn.Module, prompt: list[int], modules: list[str]) -> dict[str, torch.Tensor]:
    """Each module's value `[T, ...]` from a plain HF forward of one prompt alone."""
    values, handles = {}, []
    for spec in resolve_modules(twin, modules):
        module = twin.get_submodule(spec.path)

        def keep(value, name=spec.name):
            values[name] = (value[0] if isinstance(value, tuple) else value)[0]

        if spec.io == "output":
            handles.append(module.register_forward_hook(lambda m, a, out, keep=keep: keep(out)))
        else:
            handles.append(
                module.register_forward_pre_hook(
                    lambda m, a, kw, keep=keep: keep(a[0] if a else next(iter(kw.values()))), with_kwargs=True
                )
            )
    try:
        twin(torch.tensor([prompt]))
    finally:
        for handle in handles:
            handle.remove()
    return values


def _files(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("positions", ["all", "last"])
def test_values_equal_hf_forward(llama, tmp_path, positions):
    llm, twin = llama
    prompts = random_prompts(LENGTHS)
    summary = extract(llm, prompts, LLAMA_MODULES, tmp_path, positions=positions, shard_tokens=100, progress=False)
    assert summary.is_complete and summary.num_prompts == len(prompts) and summary.num_shards > 2
    store = load_activations(tmp_path)
    assert len(store) == len(prompts)
    for i, prompt in enumerate(prompts):
        expected = hf_values(twin, prompt, LLAMA_MODULES)
        assert store[i].token_ids.tolist() == prompt
        for module in LLAMA_MODULES:
            want = expected[module] if positions == "all" else expected[module][-1:]
            got = store[i][module]
            assert got.shape == want.shape, module
            assert_close_packed(got, want, rel=1e-4, msg=f"{module} prompt {i}")


def test_values_equal_hf_forward_gpt2(tmp_path):
    model = make_model("gpt2")
    twin = make_twin(model)
    modules = ["transformer.h.0", "transformer.h.1.mlp.c_proj.input", "transformer.ln_f"]
    prompts = random_prompts([4, 40, 9, 1])
    with nnrun.LLM(model) as llm:
        extract(llm, prompts, modules, tmp_path, progress=False)
    store = load_activations(tmp_path)
    for i, prompt in enumerate(prompts):
        expected = hf_values(twin, prompt, modules)
        for module in modules:
            assert_close_packed(store[i][module], expected[module], rel=1e-4)


def test_text_prompts_dtype_and_summary(tiny_llm, tmp_path, capsys):
    llm, tokenizer = tiny_llm
    prompts = ["The cat sat on the mat.", "Paris", "A dog ran in the park. The cat sat."]
    summary = extract(llm, prompts, "model.layers.1", tmp_path, dtype="bfloat16")
    store = load_activations(tmp_path)
    assert store.dtype == torch.bfloat16 and store[0]["model.layers.1"].dtype == torch.bfloat16
    for i, text in enumerate(prompts):
        assert store[i].token_ids.tolist() == tokenizer(text)["input_ids"]
    err = capsys.readouterr().err
    assert "prompts/s" in err and "tokens/s" in err and summary.line() in err
    assert summary.tokens_per_s > 0


def test_empty_input_gives_a_complete_empty_store(llama, tmp_path):
    summary = extract(llama[0], [], "model.layers.0", tmp_path, progress=False)
    assert summary.is_complete and summary.num_shards == 0
    store = load_activations(tmp_path)
    assert len(store) == 0 and store.is_complete and list(store.tokens("model.layers.0")) == []


def test_quiet_mode_prints_nothing(llama, tmp_path, capsys):
    extract(llama[0], random_prompts([3, 4]), "model.layers.0", tmp_path, progress=False)
    assert capsys.readouterr().err == ""


def test_nnrun_extract_is_callable_from_the_package(llama, tmp_path):
    summary = nnrun.extract(llama[0], random_prompts([3]), ["model.layers.0"], tmp_path, progress=False)
    assert summary.num_prompts == 1 and len(nnrun.load_activations(tmp_path)) == 1


class _Killed(Exception):
    pass


def test_resume_after_interruption_is_byte_identical(llama, tmp_path, monkeypatch):
    llm = llama[0]
    prompts = random_prompts(LENGTHS * 2, seed=3)
    kwargs = dict(modules=["model.layers.0", "model.layers.1.mlp.input"], shard_tokens=120, progress=False)
    extract(llm, prompts, out_dir=tmp_path / "ref", **kwargs)
    import nnrun.extract.committer as committer

    real_write, calls = committer.write_shard, []

    def write_then_die(*args):
        if len(calls) == 2:
            raise _Killed()
        calls.append(1)
        return real_write(*args)

    monkeypatch.setattr(committer, "write_shard", write_then_die)
    with pytest.raises(_Killed):
        extract(llm, prompts, out_dir=tmp_path / "run", **kwargs)
    monkeypatch.undo()
    assert len(load_activations(tmp_path / "run").manifest.shards) == 2
    summary = extract(llm, prompts, out_dir=tmp_path / "run", **kwargs)
    assert summary.num_resumed_shards == 2 and summary.num_new_prompts < len(prompts)
    assert _files(tmp_path / "run") == _files(tmp_path / "ref")
    again = extract(llm, prompts, out_dir=tmp_path / "run", **kwargs)  # complete: nothing to do
    assert again.num_new_prompts == 0 and _files(tmp_path / "run") == _files(tmp_path / "ref")


def test_rerun_with_other_settings_or_input_refuses(llama, tmp_path):
    llm = llama[0]
    prompts = random_prompts([5, 6, 7])
    extract(llm, prompts, "model.layers.0", tmp_path, shard_tokens=6, progress=False)
    before = _files(tmp_path)
    with pytest.raises(SettingsMismatchError, match="positions: stored 'all', now 'last'"):
        extract(llm, prompts, "model.layers.0", tmp_path, shard_tokens=6, positions="last", progress=False)
    with pytest.raises(SettingsMismatchError, match="modules"):
        extract(llm, prompts, "model.layers.1", tmp_path, shard_tokens=6, progress=False)
    with pytest.raises(FileExistsError):
        extract(llm, prompts, "model.layers.0", tmp_path, shard_tokens=6, resume=False, progress=False)
    other = nnrun.LLM(make_model("llama", seed=1))
    with pytest.raises(SettingsMismatchError, match="weights_sha256"):
        extract(other, prompts, "model.layers.0", tmp_path, shard_tokens=6, progress=False)
    other.shutdown()
    assert _files(tmp_path) == before


def test_changed_input_is_refused_on_resume(llama, tmp_path):
    llm = llama[0]
    extract(llm, random_prompts([5, 6, 7]), "model.layers.0", tmp_path, shard_tokens=6, limit=2, progress=False)
    manifest_path = tmp_path / "manifest.json"
    text = manifest_path.read_text().replace('"is_complete": true', '"is_complete": false')
    manifest_path.write_text(text)
    with pytest.raises(SettingsMismatchError, match="input"):
        extract(
            llm, random_prompts([5, 6, 7], seed=9), "model.layers.0", tmp_path, shard_tokens=6, limit=2, progress=False
        )


def test_bad_items_stop_by_default_with_their_location(tiny_llm, tmp_path):
    llm, _ = tiny_llm
    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "The cat"}\n{"text": ""}\n{"body": "x"}\n')
    with pytest.raises(InputError, match=r"p.jsonl line 2: empty prompt.*--on-error skip"):
        extract(llm, path, "model.layers.0", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()  # a first run that stored nothing leaves no settings behind


def test_bad_items_skipped_are_recorded(tiny_llm, tmp_path):
    llm, _ = tiny_llm
    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "The cat"}\n{"text": ""}\n{"body": "x"}\n{"text": 3}\n{"text": "A dog ran"}\n\n')
    summary = extract(llm, path, "model.layers.0", tmp_path / "out", on_error="skip", progress=False, text_field="text")
    store = load_activations(tmp_path / "out")
    assert summary.num_skipped == 4 and len(store) == 2 and store[1].input_index == 4
    assert [(s["index"], s["line"]) for s in store.skipped] == [(1, 2), (2, 3), (3, 4), (5, 6)]
    assert store.skipped[0]["reason"] == "empty prompt"
    assert store.skipped[1]["reason"].startswith("missing text field 'text'")


def test_long_prompts_error_or_truncate(llama, tmp_path):
    llm, twin = llama
    prompts = random_prompts([4, 20, 6])
    with pytest.raises(InputError, match="item 1: the prompt has 20 tokens, more than max_length 8"):
        extract(llm, prompts, "model.layers.0", tmp_path / "a", max_length=8, progress=False)
    extract(llm, prompts, "model.layers.0", tmp_path / "b", max_length=8, truncate=True, progress=False)
    store = load_activations(tmp_path / "b")
    assert [store[i].num_tokens for i in range(3)] == [4, 8, 6]
    expected = hf_values(twin, prompts[1][:8], ["model.layers.0"])["model.layers.0"]
    assert_close_packed(store[1]["model.layers.0"], expected, rel=1e-4)


def test_disk_full_keeps_the_complete_shards(llama, tmp_path, monkeypatch):
    llm = llama[0]
    prompts = random_prompts([5, 6, 7, 8, 9])
    kwargs = dict(modules="model.layers.0", shard_tokens=12, progress=False)
    extract(llm, prompts, out_dir=tmp_path / "ref", **kwargs)
    import nnrun.extract.shards as shards

    real_write, calls = shards.write_safetensors, []

    def fill_disk(path, tensors):
        calls.append(path)
        if len(calls) == 2:
            path.write_bytes(b"half a shard")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(path, tensors)

    monkeypatch.setattr(shards, "write_safetensors", fill_disk)
    with pytest.raises(ShardWriteError, match="shard-00001.safetensors .No space left on device.*1 shards"):
        extract(llm, prompts, out_dir=tmp_path / "run", **kwargs)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["manifest.json", "shard-00000.safetensors"]
    store = load_activations(tmp_path / "run")
    assert len(store) == 2 and not store.is_complete  # shard 0 holds prompts of 5 and 6 tokens
    assert _files(tmp_path / "run")["shard-00000.safetensors"] == store.manifest.shards[0].sha256
    extract(llm, prompts, out_dir=tmp_path / "run", **kwargs)
    assert _files(tmp_path / "run") == _files(tmp_path / "ref")


def test_forwards_stop_after_the_deepest_wanted_module(llama, tmp_path):
    llm, twin = llama
    prompts = random_prompts([60, 50, 40, 30, 20])  # three forward batches under the 128-token budget
    calls = []
    handle = llm.model.get_submodule("model.layers.1").register_forward_hook(lambda *args: calls.append(1))
    try:
        extract(llm, prompts, "model.layers.0.mlp", tmp_path, progress=False)
    finally:
        handle.remove()
    assert len(calls) == 1  # only the job's first forward, which shows the packing, runs the whole model
    store = load_activations(tmp_path)
    for i in (0, 4):
        expected = hf_values(twin, prompts[i], ["model.layers.0.mlp"])["model.layers.0.mlp"]
        assert_close_packed(store[i]["model.layers.0.mlp"], expected, rel=1e-4)


def test_capture_ignores_forwards_on_other_threads():
    model = make_model("llama")
    with ActivationCapture(model, resolve_modules(model, ["model.layers.0"]), torch.float32) as capture:
        other = threading.Thread(target=lambda: model(torch.tensor([[1, 2, 3]])))
        other.start()
        other.join()
        model(torch.tensor([[4, 5]]))
        values = capture.take(2)
    assert values["model.layers.0"].shape == (2, 64)


def test_unknown_module_is_refused_with_a_suggestion(llama, tmp_path):
    with pytest.raises(ValueError, match="did you mean model.layers.1.mlp"):
        extract(llama[0], random_prompts([3]), "model.layers.1.mlpp", tmp_path, progress=False)
    with pytest.raises(ValueError, match="listed twice"):
        resolve_modules(llama[0].model, ["model.layers.0", "model.layers.0.output"])


def test_any_object_with_run_is_an_executor(llama, tmp_path):
    """The executor interface: `run(ExtractionRequest)`; one that delegates writes the local folder's bytes."""
    from nnrun.extract import ExtractionRequest, LocalExecutor

    class Recording:
        def __init__(self):
            self.requests = []

        def run(self, request):
            self.requests.append(request)
            return LocalExecutor().run(request)

    llm = llama[0]
    prompts = random_prompts([5, 9, 3])
    extract(llm, prompts, "model.layers.0", tmp_path / "local", progress=False)
    recording = Recording()
    extract(llm, prompts, "model.layers.0", tmp_path / "custom", progress=False, executor=recording)
    (request,) = recording.requests
    assert isinstance(request, ExtractionRequest) and request.out_dir == tmp_path / "custom"
    assert _files(tmp_path / "local") == _files(tmp_path / "custom")
    with pytest.raises(ValueError, match=r"num_engines, ray_address and verbose do not apply to Recording"):
        extract(llm, prompts, "model.layers.0", tmp_path / "x", executor=recording, num_engines=2)
    with pytest.raises(ValueError, match=r"executor must be 'local', 'ray', a RayExecutor or an object with run"):
        extract(llm, prompts, "model.layers.0", tmp_path / "y", executor="dask")
