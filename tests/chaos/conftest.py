"""Fixtures of the chaos suite: one tiny-facts model with solo oracles, and a leak check per test."""

from __future__ import annotations

import threading

import pytest
from chaos_helpers import TinyFacts, assert_clean

import nnrun


@pytest.fixture(scope="session")
def tiny_facts():
    model = nnrun.LanguageModel("tiny-facts")
    yield TinyFacts(model, nnrun.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    model.shutdown()


@pytest.fixture
def clean_after(tiny_facts):
    """Each test leaves no request, KV page, mediator, greenlet, hook or thread behind."""
    threads_before = {t.ident for t in threading.enumerate()}
    yield
    assert_clean(tiny_facts.model, threads_before)
