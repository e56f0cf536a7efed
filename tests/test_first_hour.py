"""A newcomer's first hour: the README's extraction command verbatim, the quickstart's model in every
entry point, one-line refusals of anything else, and a missing text field that says what to do."""

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import nnrun
from nnrun.cli import main
from tolerance import assert_close_packed

REPO = Path(__file__).resolve().parent.parent
FACTS = REPO / "nnrun" / "assets" / "facts.jsonl"


def _readme_command(name: str) -> list[str]:
    """The README's one `nnrun <name> ...` command line (in a bash block), split as a shell would."""
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    lines = [line for block in blocks for line in block.splitlines() if line.startswith(f"nnrun {name} ")]
    assert len(lines) == 1, lines
    return shlex.split(lines[0], comments=True)


def _facts(count: int | None = None) -> list[str]:
    records = [json.loads(line) for line in FACTS.read_text().splitlines()]
    return [record["prompt"] for record in records[:count]]


@pytest.fixture(scope="module")
def hf_tiny_facts():
    """The bundled model as plain HF builds it (the oracle) and its tokenizer."""
    path = nnrun.bundled_model_path("tiny-facts")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def _hf_layer_output(hf_tiny_facts, prompt: str, layer: int) -> torch.Tensor:
    """`model.layers[layer]`'s output for one prompt, read by a forward hook: [T, H]."""
    model, tokenizer = hf_tiny_facts
    seen = []
    hook = model.model.layers[layer].register_forward_hook(
        lambda module, args, output: seen.append((output[0] if isinstance(output, tuple) else output)[0])
    )
    try:
        with torch.no_grad():
            model(**tokenizer(prompt, return_tensors="pt"))
    finally:
        hook.remove()
    return seen[0]


def test_readme_extract_command_runs_verbatim(hf_tiny_facts, tmp_path, monkeypatch):
    argv = _readme_command("extract")
    assert argv[0] == "nnrun"
    # The command names paths relative to a clone's root: give it that layout, with its output here.
    (tmp_path / "nnrun" / "assets").mkdir(parents=True)
    shutil.copy(FACTS, tmp_path / "nnrun" / "assets" / "facts.jsonl")
    monkeypatch.chdir(tmp_path)
    assert main(argv[1:]) == 0
    store = nnrun.load_activations(argv[argv.index("--out") + 1])
    prompts = _facts()
    assert len(store) == len(prompts) == 100
    for i in (0, 41, 99):
        expected = _hf_layer_output(hf_tiny_facts, prompts[i], 2)[-1:]  # --positions last: [1, H]
        assert_close_packed(store[i]["model.layers.2"], expected, msg=f"prompt {i}")


def test_extract_takes_the_quickstart_language_model(hf_tiny_facts, tmp_path):
    model = nnrun.LanguageModel("tiny-facts")
    try:
        prompts = _facts(6)
        summary = nnrun.extract(model, prompts, ["model.layers.2"], tmp_path / "acts", progress=False)
        assert summary.num_prompts == 6
        store = nnrun.load_activations(tmp_path / "acts")
        for i, prompt in enumerate(prompts):
            assert_close_packed(store[i]["model.layers.2"], _hf_layer_output(hf_tiny_facts, prompt, 2), msg=prompt)
        with model.trace(prompts[0]):  # the job ran on the model's own engine, which keeps serving it
            hidden = model.model.layers[2].output.save()
        assert_close_packed(hidden[0], _hf_layer_output(hf_tiny_facts, prompts[0], 2))
        llm = nnrun.LLM(model)  # a new engine over the same weights, in memory
        try:
            assert llm.model is model.engine.model and llm.tokenizer is model.tokenizer
        finally:
            llm.shutdown()
    finally:
        model.shutdown()


def test_extract_takes_nnsights_own_language_model(hf_tiny_facts, tmp_path):
    nnsight = pytest.importorskip("nnsight")
    model = nnsight.LanguageModel(str(nnrun.bundled_model_path("tiny-facts")), dispatch=True)
    prompts = _facts(3)
    nnrun.extract(model, prompts, "model.layers.1", tmp_path / "acts", progress=False)
    store = nnrun.load_activations(tmp_path / "acts")
    for i, prompt in enumerate(prompts):
        assert_close_packed(store[i]["model.layers.1"], _hf_layer_output(hf_tiny_facts, prompt, 1), msg=prompt)


@pytest.mark.parametrize(
    "bad, named",
    [
        (torch.nn.Linear(4, 4), "torch.nn.modules.linear.Linear (a torch module, not a transformers PreTrainedModel)"),
        (42, "type int"),
        ({"model": "tiny-facts"}, "type dict"),
    ],
)
def test_entry_points_refuse_other_objects_in_one_line(bad, named, tmp_path):
    entry_points = {
        "nnrun.LLM": lambda: nnrun.LLM(bad),
        "nnrun.LanguageModel": lambda: nnrun.LanguageModel(bad),
        "nnrun.extract": lambda: nnrun.extract(bad, ["a"], "model.layers.0", tmp_path / "out"),
    }
    for where, call in entry_points.items():
        with pytest.raises(TypeError) as caught:
            call()
        message = str(caught.value)
        assert "\n" not in message and len(message) < 300, (where, message)
        assert named in message and "a transformers PreTrainedModel" in message and "LanguageModel" in message
    assert not (tmp_path / "out").exists()  # refused before any file was opened


def _extract_args(input_path: Path, out: Path, *extra: str) -> list[str]:
    base = ["extract", "--model", "tiny-facts", "--input", str(input_path), "--module", "model.layers.0"]
    return [*base, "--out", str(out), "-q", *extra]


def test_missing_text_field_names_the_flag_and_leaves_nothing_behind(tmp_path, capsys):
    path = tmp_path / "notes.jsonl"
    path.write_text("".join(json.dumps({"body": f"The cat sat {i}", "title": "cats", "n": i}) + "\n" for i in range(3)))
    out = tmp_path / "acts"
    assert main(_extract_args(path, out)) == 1
    error = capsys.readouterr().err
    assert "notes.jsonl line 1: missing text field 'prompt' or 'text'" in error
    assert "(fields: body, title, n)" in error and "--text-field NAME" in error
    assert "on_error='skip'" not in error  # skipping every record is not the fix
    assert not out.exists()  # no manifest claims the folder with the failed run's settings
    assert main(_extract_args(path, out, "--text-field", "body")) == 0  # the corrected run goes through at once
    store = nnrun.load_activations(out)
    assert len(store) == 3 and store.manifest.settings["text_field"] == "body"


def test_failed_first_run_into_an_existing_folder_keeps_the_folder(tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text('{"body": "the cat", "title": "cats"}\n')
    out = tmp_path / "acts"
    out.mkdir()
    assert main(_extract_args(path, out)) == 1
    assert out.is_dir() and list(out.iterdir()) == []
    assert "--text-field NAME" in capsys.readouterr().err


def test_a_records_only_string_field_is_its_prompt(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"sentence": "the cat sat", "id": 1}\n{"text": "a dog ran", "id": 2}\n{"prompt": "Paris is"}\n')
    assert main(_extract_args(path, tmp_path / "acts")) == 0
    store = nnrun.load_activations(tmp_path / "acts")
    tokenizer = AutoTokenizer.from_pretrained(nnrun.bundled_model_path("tiny-facts"))
    for i, text in enumerate(["the cat sat", "a dog ran", "Paris is"]):
        assert store[i].token_ids.tolist() == tokenizer(text)["input_ids"]
