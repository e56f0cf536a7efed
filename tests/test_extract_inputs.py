"""Prompt sources of extraction jobs: each format, record numbers, bad items, limits."""

import json

import pytest

from nnrun.extract.inputs import InputError, PromptRecord, check_prompt, open_prompts
from nnrun.extract.prepare import LengthPolicy, PreparedPrompt, SkippedPrompt, prepare_prompts


def _summary(source):
    return [(r.index, r.location, r.prompt, r.error) for r in source.records()]


def test_iterable_of_strings_and_token_lists():
    records = _summary(open_prompts(["a b", [1, 2, 3], "", [], 7, None, [1, -2], {"text": "c"}]))
    assert records[0] == (0, "item 0", "a b", None)
    assert records[1] == (1, "item 1", [1, 2, 3], None)
    assert records[2][3] == "empty prompt"
    assert records[3][3] == "empty token id list"
    assert records[4][3] == "expected a string or a list of token ids, got int"
    assert records[5][3] == "missing value (null)"
    assert "non-negative integers" in records[6][3]
    assert records[7][2] == "c"  # dict items use the text field


def test_txt_one_prompt_a_line_with_line_numbers(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("first prompt\nsecond\r\n\nfourth\n", encoding="utf-8")
    records = _summary(open_prompts(path))
    assert [r[2] for r in records] == ["first prompt", "second", None, "fourth"]
    assert records[2][1:] == ("p.txt line 3", None, "empty prompt")
    assert [r.line for r in open_prompts(path).records()] == [1, 2, 3, 4]
    assert open_prompts(path).total == 4
    path.write_text("no newline at the end\nlast")
    assert open_prompts(path).total == len(list(open_prompts(path).records())) == 2


def test_txt_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "p.txt"
    path.write_bytes(b"ok\n\xff\xfe bad\n")
    with pytest.raises(InputError, match="p.txt line 2: not valid UTF-8"):
        list(open_prompts(path).records())


def test_jsonl_records_and_their_errors(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [{"text": "hello"}, {"body": "x"}, {"text": 5}, "not json", "", [1, 2], {"text": [4, 5]}, {"text": ""}]
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    records = _summary(open_prompts(path, text_field="text"))
    assert records[0] == (0, "p.jsonl line 1", "hello", None)
    assert records[1][1] == "p.jsonl line 2" and records[1][3].startswith("missing text field 'text'")
    assert records[2][3] == "expected a string or a list of token ids, got int"
    assert records[3][3].startswith("invalid JSON")
    assert records[4][3] == "empty line"
    assert records[5][3] == "expected a JSON object, got list"
    assert records[6][2] == [4, 5]
    assert records[7][3] == "empty prompt"


def test_jsonl_text_field_and_limit(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"body": f"p{i}"}) for i in range(10)) + "\n")
    source = open_prompts(path, text_field="body", limit=3)
    assert [r.prompt for r in source.records()] == ["p0", "p1", "p2"]
    assert [r.prompt for r in source.records()] == ["p0", "p1", "p2"]  # re-readable


def test_parquet_records(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"text": ["a", None, "c", ""], "other": [1, 2, 3, 4]}), path)
    source = open_prompts(path)
    assert source.total == 4
    records = _summary(source)
    assert [r[2] for r in records] == ["a", None, "c", None]
    assert records[1][1:] == ("p.parquet record 1", None, "missing value (null)")
    assert records[3][3] == "empty prompt"
    with pytest.raises(InputError, match="missing text field 'body'.*columns: text, other"):
        open_prompts(path, text_field="body")


def test_saved_hf_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    datasets.Dataset.from_dict({"text": ["x y", "z"], "n": [1, 2]}).save_to_disk(str(folder))
    source = open_prompts(folder)
    assert source.kind == "dataset" and source.total == 2
    assert [(r.location, r.prompt) for r in source.records()] == [("ds record 0", "x y"), ("ds record 1", "z")]
    dict_folder = tmp_path / "dsd"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["t"]})}).save_to_disk(str(dict_folder))
    assert [r.prompt for r in open_prompts(dict_folder).records()] == ["t"]


def test_unknown_inputs_are_refused(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        open_prompts(tmp_path / "missing.txt")
    (tmp_path / "p.csv").write_text("a\n")
    with pytest.raises(InputError, match="unknown format '.csv'"):
        open_prompts(tmp_path / "p.csv")
    with pytest.raises(ValueError, match="limit"):
        open_prompts(["a"], limit=-1)


def test_record_needs_exactly_one_of_prompt_and_error():
    with pytest.raises(ValueError):
        PromptRecord(0, "item 0", None, None)
    assert check_prompt({"x": 1}, "text")[1] == (
        "missing text field 'text' (fields: x); name the field that holds the prompt with --text-field NAME "
        "(text_field=NAME in Python)"
    )


class _WordTokenizer:
    """Splits on spaces; ids are word lengths, plus a BOS of 0."""

    def __call__(self, texts):
        return {"input_ids": [[0] + [len(w) for w in t.split()] for t in texts]}


def test_prepare_checks_vocab_and_length():
    records = list(open_prompts(["a bb ccc", [1, 2, 3, 4, 5, 6], [99], "", "a " * 600]).records())
    policy = LengthPolicy(max_length=4, is_user_limit=True)
    items = list(prepare_prompts(records, _WordTokenizer(), vocab_size=50, policy=policy))
    assert items[0] == PreparedPrompt(0, [0, 1, 2, 3])
    assert isinstance(items[1], SkippedPrompt) and "6 tokens, more than max_length 4" in items[1].reason
    assert "token id 99 is outside the model's vocabulary [0, 50)" in items[2].reason
    assert items[3].reason == "empty prompt" and items[3].message() == "item 3: empty prompt"
    assert len(items) == 5
    truncated = list(prepare_prompts(records[:2], _WordTokenizer(), 50, LengthPolicy(4, True, truncate=True)))
    assert truncated[1] == PreparedPrompt(1, [1, 2, 3, 4], is_truncated=True)


def test_prepare_text_without_tokenizer_is_a_bad_item():
    records = list(open_prompts(["text"]).records())
    [item] = prepare_prompts(records, None, 10, LengthPolicy(8, False))
    assert "needs a tokenizer" in item.reason
