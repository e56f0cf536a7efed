"""The full family sweep (make test-all): every causal LM family in transformers, exact against HF or refused by name."""

from __future__ import annotations

import pytest

from families.sweep import check_family
from families.tiny import causal_lm_families

pytestmark = pytest.mark.slow  # all of transformers' causal LM families: about a minute on 2 cores


@pytest.mark.parametrize("model_type", causal_lm_families())
def test_family_is_exact_or_refused_by_name(model_type):
    result = check_family(model_type)  # raises if nnrun's numbers differ from HF's
    assert result.path in ("packed", "exact", "refused"), f"{model_type}: {result.path} ({result.detail})"
    if result.path == "refused":
        assert model_type in result.detail
