"""The server's compiled blocks, without HTTP: payloads from nnrun's client run by `run_trace` on an
in-process `ServedLanguageModel`, against the same traces run locally (the oracle).

Traces of one block share one compiled block (parsed and compiled once), two different blocks at
the same file and line stay apart (nnsight caches a block's inner invokes by filename and line),
and a block nobody runs is forgotten once the cache is full, never while a request runs it.
"""

from __future__ import annotations

import linecache
import textwrap

import torch

from nnsight.tracing.globals import BLOCKS, SOURCES

from nnrun.serve import payload, trace_route, wire
from nnrun.serve.engine_model import RequestLimits

PROMPTS = ["The Eiffel Tower is in", "The Colosseum is in"]
CLIENT_FILE = "notebook_cell.py"  # both clients' blocks claim this file and these lines


def _run(served, blob: bytes) -> dict:
    """A payload run again, straight on the server's model."""
    result = wire.decode_result(trace_route.run_trace(served, blob, RequestLimits(60, 10), raw_tensors=True))
    wire.raise_remote_error(result["error"])
    return result["saves"]


def _define(source: str, name: str):
    """A function compiled from `source` as if it lived in CLIENT_FILE (a fresh notebook cell, say)."""
    linecache.cache[CLIENT_FILE] = (len(source), None, source.splitlines(keepends=True), CLIENT_FILE)
    SOURCES.pop(CLIENT_FILE, None)  # the client's nnsight reads each file once: this one changed
    for key in [key for key in BLOCKS if key[0] == CLIENT_FILE]:
        BLOCKS.pop(key)
    scope: dict = {}
    exec(compile(source, CLIENT_FILE, "exec"), scope)
    return scope[name]


def test_traces_of_one_block_share_its_compiled_form(served, client, local_model, payloads):
    def trace(model, prompt, layer):
        with model.trace(prompt):
            hidden = model.model.layers[layer].output[:, -1].save()
        return hidden

    cases = [(PROMPTS[0], 0), (PROMPTS[1], 2), (PROMPTS[0], 1)]
    blocks_before = len(payload.BLOCKS_COMPILED)
    served_results = [trace(client, prompt, layer) for prompt, layer in cases]
    assert len(payload.BLOCKS_COMPILED) == blocks_before + 1  # three traces, one compiled block
    for saved, (prompt, layer) in zip(served_results, cases):
        torch.testing.assert_close(saved, trace(local_model, prompt, layer), rtol=1e-5, atol=1e-5)
    assert all(block.users == 0 for block in payload.BLOCKS_COMPILED._blocks.values())


SOURCE_A = textwrap.dedent("""
    def run(model, tracer_prompts):
        with model.trace() as tracer:
            with tracer.invoke(tracer_prompts[0]):
                first = model.model.layers[0].output[:, -1].save()
            with tracer.invoke(tracer_prompts[1]):
                second = model.model.layers[0].output[:, 0].save()
        return first, second
""")
SOURCE_B = textwrap.dedent("""
    def run(model, tracer_prompts):
        with model.trace() as tracer:
            with tracer.invoke(tracer_prompts[0]):
                first = model.model.layers[3].output[:, 0].save()
            with tracer.invoke(tracer_prompts[1]):
                second = model.lm_head.output[:, -1].save()
        return first, second
""")


def test_different_blocks_at_one_file_and_line_stay_apart(served, client, local_model, payloads):
    """Two clients' blocks at the same file, function and lines, with invokes inside: each runs its own."""
    run_a = _define(SOURCE_A, "run")
    served_a = run_a(client, PROMPTS)
    expected_a = run_a(local_model, PROMPTS)
    run_b = _define(SOURCE_B, "run")
    served_b = run_b(client, PROMPTS)
    expected_b = run_b(local_model, PROMPTS)
    for got, expected in [(served_a, expected_a), (served_b, expected_b)]:
        for ours, theirs in zip(got, expected):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(expected_a[0], expected_b[0])  # the two blocks read different values
    for blob, expected in zip(payloads, [expected_a, expected_b]):  # again: nnsight's per-line caches are warm now
        saves = _run(served, blob)
        for ours, theirs in zip((saves["first"], saves["second"]), expected):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_full_cache_forgets_idle_blocks_only():
    cache = payload._BlockCache(size=1)
    first = cache.acquire("a.py", "f", "x = 1\n")
    second = cache.acquire("a.py", "f", "x = 2\n")
    assert len(cache) == 2  # over its size, but both are in use
    BLOCKS[(first.filename, 1, "<module>", 1)] = (None, None)  # what nnsight caches for an inner block
    cache.release(first)
    assert len(cache) == 1
    assert first.filename not in linecache.cache and (first.filename, 1, "<module>", 1) not in BLOCKS
    assert second.filename in linecache.cache  # still running: kept
    again = cache.acquire("a.py", "f", "x = 2\n")
    assert again is second and again.users == 2
    cache.release(second)
    cache.release(again)
    assert len(cache) == 1 and second.filename in linecache.cache  # idle, within the size: kept for the next
    second.forget()
