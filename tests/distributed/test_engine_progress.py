"""Progress over many engines: counts per forward, each range counted once, `nnrun extract --ray -v` lines."""

from __future__ import annotations

import re

import pytest
from ray_helpers import BAD_LINES, JOB, MODEL, MODULES, job_prompts

from nnrun.distributed import RayExecutor
from nnrun.distributed.engine import EngineSpec, ExtractionEngine
from nnrun.distributed.progress import EngineProgress
from nnrun.extract import extract
from nnrun.extract.job import ExtractionOptions
from nnrun.extract.manifest import Manifest
from nnrun.extract.prepare import PreparedPrompt


def test_each_range_counts_once_whatever_the_reports():
    progress = EngineProgress(False, None, num_engines=2)
    progress.range_started(0)
    progress.range_started(1)
    progress.range_progress(0, 0, 2, 50)
    progress.range_progress(0, 0, 1, 20)  # engine 0 restarted and redoes range 0 from its start
    assert (progress.num_prompts, progress.num_tokens) == (2, 50)
    progress.range_progress(1, 1, 3, 70)
    progress.range_done(0, 0, 5, 120, pid=11)
    progress.range_progress(0, 0, 5, 120)  # a poll answered after the range came back
    progress.range_done(1, 1, 4, 100, pid=12)
    assert (progress.num_prompts, progress.num_tokens) == (9, 220)
    assert progress.engine_tokens == [120, 100]


def test_verbose_close_leaves_each_engines_exact_count(capsys):
    progress = EngineProgress(True, 10, num_engines=2, verbose=True)
    progress.range_started(0)
    progress.range_done(1, 0, 4, 96, pid=7, elapsed_s=0.5)
    progress.range_started(1)
    progress.range_done(1, 1, 4, 30, pid=8, elapsed_s=0.25)  # a new pid: Ray restarted engine 1
    progress.close()
    err = capsys.readouterr().err
    assert "engine 0: 0 tokens, 0 ranges" in err
    assert "engine 1: 126 tokens, 2 ranges, busy 0.8 s, pid 8, 1 restarts" in err


def test_engine_counts_every_forward_of_its_range():
    """What a poll reads while a range runs: the counts after each forward batch, not only at the range's end."""
    options = ExtractionOptions(shard_tokens=JOB["shard_tokens"])
    engine = ExtractionEngine(EngineSpec(MODEL, None, JOB["llm_kwargs"], MODULES, options, "text", None, num_threads=1))
    try:
        tokenizer = engine.llm.tokenizer
        prompts = [PreparedPrompt(i, tokenizer(text)["input_ids"]) for i, text in enumerate(job_prompts(12))]
        seen = []
        forward = engine.job._forward

        def counting_forward(batch):
            seen.append((engine.progress(), len(batch), sum(p.num_tokens for p in batch)))
            return forward(batch)

        engine.job._forward = counting_forward
        assert engine.progress() is None
        engine.run_range(3, prompts)
        assert engine.progress() is None  # between ranges
    finally:
        engine.shutdown()
    assert len(seen) > 2  # JOB's small forward batches: several per range
    num_prompts = num_tokens = 0
    for report, batch_prompts, batch_tokens in seen:
        assert (report.number, report.num_prompts, report.num_tokens) == (3, num_prompts, num_tokens)
        num_prompts, num_tokens = num_prompts + batch_prompts, num_tokens + batch_tokens
    assert (num_prompts, num_tokens) == (len(prompts), sum(p.num_tokens for p in prompts))


def test_driver_polls_move_the_bars_mid_range(ray_address, prompts_file, tmp_path, monkeypatch):
    reports, range_tokens = [], {}
    range_progress, range_done = EngineProgress.range_progress, EngineProgress.range_done

    def recording_progress(self, engine, number, num_prompts, num_tokens):
        reports.append((number, num_tokens))
        range_progress(self, engine, number, num_prompts, num_tokens)

    def recording_done(self, engine, number, num_prompts, num_tokens, pid, elapsed_s):
        range_tokens[number] = num_tokens
        range_done(self, engine, number, num_prompts, num_tokens, pid, elapsed_s)

    monkeypatch.setattr(EngineProgress, "range_progress", recording_progress)
    monkeypatch.setattr(EngineProgress, "range_done", recording_done)
    job = {**JOB, "progress": True, "shard_tokens": 3000}  # longer ranges: many forwards each
    executor = RayExecutor(num_engines=2, verbose=True, poll_interval_s=0.01)
    summary = extract(MODEL, str(prompts_file), MODULES, tmp_path, executor=executor, **job)
    assert summary.is_complete
    assert summary.num_new_tokens == Manifest.load(tmp_path).num_tokens
    # Some poll caught a range part-way: its forwards were counted before its rows came back.
    assert any(0 < num_tokens < range_tokens[number] for number, num_tokens in reports), (reports, range_tokens)


def test_cli_verbose_shows_a_line_per_engine(ray_address, prompts_file, tmp_path, capsys):
    from nnrun.cli import main

    out = tmp_path / "out"
    argv = [
        "extract",
        "--model",
        MODEL,
        "--input",
        str(prompts_file),
        "--module",
        *MODULES,
        "--out",
        str(out),
        "--shard-tokens",
        str(JOB["shard_tokens"]),
        "--batch-tokens",
        str(JOB["llm_kwargs"]["max_num_batched_tokens"]),
        "--on-error",
        "skip",
        "--ray",
        ray_address,
        "--engines",
        "2",
        "-v",
    ]
    assert main(argv) == 0
    err = capsys.readouterr().err
    manifest = Manifest.load(out)
    assert manifest.num_prompts == len(job_prompts()) - len(BAD_LINES)
    for engine in (0, 1):  # the live tqdm bar of each engine, counting tokens
        assert re.search(rf"engine {engine}: [^\n\r]*tok", err), err[-3000:]
    finals = {int(m[1]): int(m[2]) for m in re.finditer(r"engine (\d+): (\d+) tokens, \d+ ranges", err)}
    assert sorted(finals) == [0, 1] and sum(finals.values()) == manifest.num_tokens, err[-3000:]
    summary = re.search(r"extracted (\d+) prompts \((\d+) tokens\)", err)
    assert summary is not None, err[-3000:]
    assert (int(summary[1]), int(summary[2])) == (manifest.num_prompts, manifest.num_tokens)
    job_bar = re.findall(r"extract: [^\n\r]*?(\d+)/(\d+) \[", err)  # the one bar over all engines, in prompts
    assert job_bar and job_bar[-1][0] == job_bar[-1][1] == str(len(job_prompts())), err[-3000:]


def test_poll_interval_is_checked():
    with pytest.raises(ValueError, match="poll_interval_s must be positive"):
        RayExecutor(poll_interval_s=0)
