"""Progress of a job over many engines: the job's one bar (prompts, tokens/s, ETA) and, verbose, a line per engine."""

from __future__ import annotations

import sys

from tqdm import tqdm

from nnrun.extract.progress import ExtractionSummary, Progress


class EngineProgress(Progress):
    """The job's bar counts every engine's finished ranges; `verbose` adds one bar per engine below it."""

    def __init__(self, enabled: bool, total: int | None, initial: int = 0, *, num_engines: int = 1,
                 verbose: bool = False) -> None:
        super().__init__(enabled, total, initial)
        self.engine_pids: list[set[int]] = [set() for _ in range(num_engines)]  # a second pid: Ray restarted it
        self._engine_bars = [
            tqdm(unit="tok", unit_scale=True, desc=f"engine {i}", position=i + 1, file=sys.stderr,
                 dynamic_ncols=True, leave=False)
            for i in range(num_engines)
        ] if enabled and verbose else []

    def range_done(self, engine: int, num_prompts: int, num_tokens: int, pid: int) -> None:
        """Count a range that `engine` (in process `pid`) finished."""
        self.update(num_prompts, num_tokens)
        self.engine_pids[engine].add(pid)
        if self._engine_bars:
            bar = self._engine_bars[engine]
            bar.update(num_tokens)
            restarts = len(self.engine_pids[engine]) - 1
            bar.set_postfix_str(f"pid {pid}" + (f", {restarts} restarts" if restarts else ""), refresh=False)

    def close(self, summary: ExtractionSummary | None = None) -> None:
        for bar in self._engine_bars:
            bar.close()
        super().close(summary)
