"""nnsight's LanguageModel constructor keywords on nnrun.LanguageModel: nnsight's meaning, or refused by name."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, LlamaConfig

import nnrun
from conformance.compare import assert_same
from conformance.models import hf_language_model, tiny_llama, tiny_tokenizer
from interleaver.keywords import engine_kwargs
from tolerance import assert_close_packed

P = "the eiffel tower is in the city of"


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def oracle(tokenizer):
    return hf_language_model(tiny_llama(seed=3), tokenizer)


def build(tokenizer, **kwargs):
    import nnrun

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return nnrun.LanguageModel(tiny_llama(seed=3), tokenizer=tokenizer, **kwargs)


def logits(model) -> torch.Tensor:
    with model.trace(P):
        out = model.lm_head.output.save()
    return out


# Keywords that choose what nnrun always does (or name the only thing it does): the model runs as without them.
ACCEPTED = [
    {"dispatch": True},
    {"dispatch": False},
    {"meta_buffers": True},
    {"low_cpu_mem_usage": True},
    {"attn_implementation": "sdpa"},
    {"attn_implementation": "eager"},
    {"automodel": AutoModelForCausalLM},
    {"automodel": "AutoModelForCausalLM"},
    {"task": "text-generation"},
    {"peft": None, "processor": None, "quantization_config": None, "max_memory": None},
    {"use_fast": True},
    {"trust_remote_code": False, "revision": None},
    {"device_map": "cpu"},
    {"device_map": {"": "cpu"}},
    {"device_map": None},
    {"torch_dtype": torch.float32},
]


@pytest.mark.parametrize("kwargs", ACCEPTED, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_keywords_nnsight_accepts_build_the_same_model(tokenizer, oracle, kwargs):
    ours = build(tokenizer, **kwargs)
    try:
        assert_same(logits(oracle), logits(ours))
    finally:
        ours.shutdown()


def test_torch_dtype_is_dtype(tokenizer):
    ours = build(tokenizer, torch_dtype=torch.bfloat16)
    try:
        assert ours.engine.model.dtype == torch.bfloat16
        assert ours.engine.config.device.torch_dtype == torch.bfloat16
    finally:
        ours.shutdown()


def test_dtype_and_torch_dtype_must_agree(tokenizer):
    with pytest.raises(ValueError, match="dtype=.*torch_dtype=.*same setting"):
        build(tokenizer, dtype=torch.float16, torch_dtype=torch.bfloat16)


def test_tokenizer_kwargs_are_set_on_the_tokenizer_as_nnsight_sets_them(tokenizer):
    import nnsight

    mine, theirs = tiny_tokenizer(), tiny_tokenizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = nnsight.LanguageModel(
            tiny_llama(seed=3), tokenizer=theirs, tokenizer_kwargs={"padding_side": "right", "model_max_length": 77}
        )
    ours = build(mine, tokenizer_kwargs={"padding_side": "right", "model_max_length": 77})
    try:
        assert ours.tokenizer is mine
        assert (mine.padding_side, mine.model_max_length) == (reference.tokenizer.padding_side, 77) == ("right", 77)
    finally:
        ours.shutdown()


def test_engine_options_still_work_beside_nnsights_keywords(tokenizer):
    ours = build(tokenizer, dispatch=True, max_num_seqs=3, page_size=8, revision="main")
    try:
        assert ours.engine.config.scheduler.max_num_seqs == 3
        assert ours.engine.config.cache.page_size == 8
        assert ours.engine.config.model.revision == "main"
    finally:
        ours.shutdown()


def test_an_unknown_keyword_is_still_an_error(tokenizer):
    with pytest.raises(ValueError, match="unknown engine option 'dispach'"):
        build(tokenizer, dispach=True)


REFUSED = [
    ({"device_map": "auto"}, "device_map"),
    ({"device_map": "balanced"}, "device_map"),
    ({"device_map": {"model.layers.0": "cpu", "lm_head": "cuda:0"}}, "device_map"),
    ({"peft": "someone/adapter"}, "peft"),
    ({"task": "fill-mask"}, "task"),
    ({"processor": object()}, "processor"),
    ({"quantization_config": {"load_in_4bit": True}}, "quantization_config"),
    ({"max_memory": {0: "10GB"}}, "max_memory"),
    ({"tp_plan": "auto"}, "tp_plan"),
    ({"use_fast": False}, "use_fast"),
    ({"token": "hf_abc"}, "token"),
    ({"automodel": AutoModel}, "automodel"),
    ({"config": LlamaConfig()}, "config"),
    ({"envoys": {}}, "envoys"),
]


@pytest.mark.parametrize("kwargs,name", REFUSED, ids=[name for _, name in REFUSED])
def test_keywords_nnrun_cannot_honour_are_refused_by_name(tokenizer, kwargs, name):
    with pytest.raises(NotImplementedError, match=rf"LanguageModel\({name}="):
        build(tokenizer, **kwargs)


def test_a_one_device_map_is_the_device():
    assert engine_kwargs(None, "cpu", None, {"device_map": 0})[0] == "cuda:0"
    assert engine_kwargs(None, "cpu", None, {"device_map": {"": "cuda:1"}})[0] == "cuda:1"
    assert engine_kwargs(None, "cpu", None, {"device_map": torch.device("cpu")})[0] == "cpu"
    with pytest.raises(ValueError, match="device='cuda:1' and device_map='cuda:0'"):
        engine_kwargs(None, "cuda:1", None, {"device_map": "cuda:0"})


def test_config_of_the_given_model_is_accepted(tokenizer, oracle):
    import nnrun

    model = tiny_llama(seed=3)
    ours = nnrun.LanguageModel(model, tokenizer=tokenizer, config=model.config)
    try:
        assert_same(logits(oracle), logits(ours))
    finally:
        ours.shutdown()


def test_a_hub_style_load_takes_revision_and_torch_dtype():
    import nnrun

    ours = nnrun.LanguageModel("tiny-facts-gpt2", revision="main", torch_dtype="bfloat16", dispatch=True)
    try:
        assert ours.engine.model.dtype == torch.bfloat16
        assert ours.engine.config.model.revision == "main"
        with ours.trace("Paris is the capital of"):
            out = ours.lm_head.output.save()
        assert out.dtype == torch.bfloat16
    finally:
        ours.shutdown()


# ---- where a trace runs, and trace(trace=False) --------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tokenizer):
    model = build(tokenizer)
    yield model
    model.shutdown()


def test_trace_false_returns_hfs_forward_output():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import nnrun
    from nnrun.assets import bundled_model_path

    path = bundled_model_path("tiny-facts-gpt2")
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ours = nnrun.LanguageModel("tiny-facts-gpt2")
    try:
        prompt = "The Eiffel Tower is in"
        with torch.no_grad():
            expected = hf(**tokenizer(prompt, return_tensors="pt"))
        actual = ours.trace(prompt, trace=False)
        assert type(actual) is type(expected)  # GPT-2's own output class, as on HF
        assert_close_packed(actual.logits, expected.logits)
        with ours.trace(prompt) as tracer:
            result = tracer.result.save()
        assert type(result) is type(expected)
    finally:
        ours.shutdown()


@pytest.mark.parametrize(
    "keyword, value",
    [("remote", True), ("backend", object()), ("serve", "http://127.0.0.1:1"), ("blocking", False), ("api_key", "k")],
)
def test_where_to_run_keywords_are_refused_by_name_unless_default(keyword, value, tiny):
    with pytest.raises(NotImplementedError, match=keyword):
        with tiny.trace("the cat sat", **{keyword: value}):
            pass
    with pytest.raises(NotImplementedError, match=keyword):
        tiny.generate("the cat sat", max_new_tokens=1, **{keyword: value})


def test_where_to_run_keywords_at_their_defaults_are_accepted(tiny):
    with tiny.trace("the cat sat", remote=False, backend=None, blocking=True):
        out = tiny.lm_head.output.save()
    assert out.shape[1] == 3


def test_public_attributes_scripts_read_as_nnsight_sets_them():
    from nnsight import LanguageModel as NNsightLanguageModel

    from nnrun.assets import bundled_model_path

    path = str(bundled_model_path("tiny-facts"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = NNsightLanguageModel(path, dispatch=True)
    ours = nnrun.LanguageModel(path, dispatch=True)
    try:
        for name in (
            "dispatched",
            "repo_id",
            "revision",
            "args",
            "kwargs",
            "task",
            "peft",
            "processor",
            "image_processor",
            "feature_extractor",
        ):
            assert getattr(ours, name) == getattr(theirs, name), name
        assert ours.dispatch() is None and ours.dispatched
    finally:
        ours.shutdown()
