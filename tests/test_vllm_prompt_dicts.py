"""vLLM's prompt dicts (TextPrompt `{"prompt": ...}`, TokensPrompt `{"prompt_token_ids": [...]}`) on the engine.

The oracle is the same prompt given as plain text or a plain id list: the tokens must be bitwise
the same, on `generate`, `submit` and `generate_stream`.
"""

from __future__ import annotations

import pytest

import nnrun

GREEDY = nnrun.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
TEXT = "The cat sat on the mat."


def _tokens(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def test_text_and_token_dicts_generate_what_plain_prompts_do(tiny_llm):
    llm, tokenizer = tiny_llm
    ids = tokenizer(TEXT)["input_ids"]
    expected = _tokens(llm.generate([TEXT, ids], GREEDY))
    outputs = llm.generate([{"prompt": TEXT}, {"prompt_token_ids": ids}], GREEDY)
    assert _tokens(outputs) == expected
    assert outputs[0].prompt == TEXT and outputs[0].prompt_token_ids == ids
    assert outputs[1].prompt is None and outputs[1].prompt_token_ids == ids
    # A TokensPrompt may carry the text its ids came from: it is the output's prompt, the ids are what run.
    both = llm.generate({"prompt_token_ids": ids, "prompt": TEXT, "cache_salt": "user-1"}, GREEDY)
    assert _tokens(both) == expected[:1] and both[0].prompt == TEXT


def test_dicts_on_submit_and_generate_stream(tiny_llm):
    llm, tokenizer = tiny_llm
    ids = tokenizer(TEXT)["input_ids"]
    expected = _tokens(llm.generate([ids], GREEDY))[0]
    assert llm.submit({"prompt": TEXT}, GREEDY).result(timeout=60).outputs[0].token_ids == expected
    chunks = list(llm.generate_stream({"prompt_token_ids": ids}, GREEDY))
    assert len(chunks) == GREEDY.max_tokens and chunks[-1].outputs[0].token_ids == expected


@pytest.mark.parametrize(
    "prompt, match",
    [
        ({"prompt": [1, 2]}, r"prompt\['prompt'\] must be text, got list .*token ids go in 'prompt_token_ids'"),
        ({"prompt_token_ids": "abc"}, r"prompt\['prompt_token_ids'\] must be token ids, got a string"),
        ({"prompt_token_ids": [1, 10**6]}, r"prompt\['prompt_token_ids'\] token id 1000000 at position 1 is out of"),
        ({"prompt_token_ids": []}, r"prompt\['prompt_token_ids'\] has no token ids"),
        ({"prompt": ""}, r"prompt\['prompt'\] is an empty string"),
        ({"prompt": "x", "temperature": 0}, r"prompt has keys nnrun does not know: temperature"),
        (
            {"prompt": "x", "multi_modal_data": {"image": object()}},
            r"prompt has multi_modal_data: nnrun serves text-only",
        ),
        ({"prompt_token_ids": [1], "prompt": 3}, r"prompt\['prompt'\] must be the ids' text"),
    ],
)
def test_bad_dicts_are_refused_naming_the_key(tiny_llm, prompt, match):
    llm, _ = tiny_llm
    with pytest.raises(ValueError, match=match):
        llm.submit(prompt, GREEDY)
    assert llm.num_requests_in_flight == 0


def test_a_dict_that_is_not_a_vllm_prompt_is_refused(tiny_llm):
    llm, _ = tiny_llm
    with pytest.raises(ValueError, match=r"prompts must be a string, a sequence of token ids, a vLLM prompt dict"):
        llm.generate({"input": "x"}, GREEDY)
    with pytest.raises(ValueError, match=r"prompts\[1\] needs 'prompt' \(text\) or 'prompt_token_ids'"):
        llm.generate([{"prompt": TEXT}, {"cache_salt": "s"}], GREEDY)
