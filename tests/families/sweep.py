"""One family on nnrun against plain HF: exact on the packed path, exact on the exact path, or refused by name.

The oracle is the family's own HF forward, one prompt at a time: every position's logits of each
prompt, and greedy tokens by re-running the growing sequence. nnrun runs the three prompts as one
packed trace (three invokes) and as one greedy generation. Anything else (a crash, numbers that
differ) fails the check: nothing may be silently wrong.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass

import torch

from families.tiny import tiny_config, tiny_model

PROMPTS = ([17, 33, 45, 58, 61], [20, 71, 82, 93, 24, 35, 46, 57, 68, 79, 90], [101, 42, 13])  # 5, 11, 3 tokens
NUM_GREEDY_TOKENS = 3
# fp32 logits of the packed step against HF's own forward: they differ only by summation order
# (other matmul shapes and groupings), so the bound is relative to the logits' magnitude.
RELATIVE_TOLERANCE = 1e-3


@dataclass
class FamilyResult:
    model_type: str
    path: str  # "packed", "exact" (HF's own forward per request), "refused", or "not built" (the tiny config)
    detail: str = ""  # why the exact path, why refused, or why the tiny model could not be built


def hf_oracle(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Per prompt, HF's logits `[T, V]` for it alone and its greedy continuation (no cache: the plain forward)."""
    logits, continuations = [], []
    no_cache = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    with torch.no_grad():
        for prompt in PROMPTS:
            logits.append(model(input_ids=torch.tensor([prompt]), **no_cache).logits[0])
            ids = list(prompt)
            for _ in range(NUM_GREEDY_TOKENS):
                ids.append(int(model(input_ids=torch.tensor([ids]), **no_cache).logits[0, -1].argmax()))
            continuations.append(ids[len(prompt) :])
    return logits, continuations


def check_family(model_type: str) -> FamilyResult:
    """Build the family tiny and run it on nnrun; raises AssertionError if nnrun's numbers differ from HF's."""
    import nnrun
    from nnrun import SamplingParams
    from nnrun.exact import ModelRefusedError

    try:
        model = tiny_model(model_type)
    except Exception as error:  # HF cannot build it: nnrun, given the config alone, may still refuse it by name
        refused = _refused_from_config(model_type)
        return refused or FamilyResult(model_type, "not built", f"{type(error).__name__}: {_first_line(error)}")
    try:
        expected_logits, expected_tokens = hf_oracle(model)
    except Exception as error:  # HF's own forward fails: nnrun must refuse the model by name
        expected_logits = expected_tokens = None
        hf_error = f"{type(error).__name__}: {_first_line(error)}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            lm = nnrun.LanguageModel(model, max_num_seqs=4, max_model_len=64)
        except ModelRefusedError as error:
            assert model_type in str(error), f"the refusal does not name the family: {error}"
            return FamilyResult(model_type, "refused", _first_line(error))
        if expected_logits is None:
            lm.shutdown()
            return FamilyResult(model_type, "not built", f"HF's own forward fails: {hf_error}")
        try:
            logits = _packed_trace_logits(lm)
            outputs = lm.engine.generate(
                [list(p) for p in PROMPTS], SamplingParams(max_tokens=NUM_GREEDY_TOKENS, temperature=0, ignore_eos=True)
            )
            exact = lm.engine.runner.exact_forward
        finally:
            lm.shutdown()
    for prompt, actual, expected in zip(PROMPTS, logits, expected_logits):
        error = float((actual[0] - expected).abs().max() / expected.abs().max())
        assert error <= RELATIVE_TOLERANCE, f"{model_type}: logits of a {len(prompt)}-token prompt off by {error:.2g}"
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    assert tokens == expected_tokens, f"{model_type}: greedy tokens {tokens}, HF's {expected_tokens}"
    if exact is None:
        return FamilyResult(model_type, "packed")
    return FamilyResult(model_type, "exact", exact.reason or "")


def _refused_from_config(model_type: str) -> FamilyResult | None:
    """nnrun given the family's tiny config (dummy weights, as for a checkpoint): its refusal by name, else None.

    nnrun refuses some families from their config before building them (a drafter, a library the
    model's code needs that is not installed), where HF's own build fails too.
    """
    import nnrun
    from nnrun.exact import ModelRefusedError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            lm = nnrun.LanguageModel(tiny_config(model_type), load_format="dummy", max_num_seqs=4, max_model_len=64)
        except ModelRefusedError as error:
            assert model_type in str(error), f"the refusal does not name the family: {error}"
            return FamilyResult(model_type, "refused", _first_line(error))
        except Exception:  # fails as HF's build did: not refused by nnrun
            return None
    lm.shutdown()
    return None


def _packed_trace_logits(lm) -> list[torch.Tensor]:
    """The three prompts as three invokes of one trace (one packed step on the packed path)."""
    saved = []
    with lm.trace() as tracer:
        for prompt in PROMPTS:
            with tracer.invoke(list(prompt)):
                saved.append(lm.output.logits.save())
    return saved


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__
