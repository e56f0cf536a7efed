"""Progress of a job over many engines: the job's one bar (prompts, tokens/s, ETA) and, verbose, a line per engine.

Ranges move the bars twice: while they run, by the forward counts the driver polls from the
engines (monitor.py), and when they finish, by the rest of their plan's counts. Each range counts
the most any poll reported for it, so a range redone after a restart is not counted twice, and
the finished job's counts are exactly its plan's.
"""

from __future__ import annotations

import sys

from tqdm import tqdm

from nnrun.extract.progress import ExtractionSummary, Progress


class EngineProgress(Progress):
    """The job's bar counts every engine's forwards; `verbose` adds one bar per engine below it."""

    def __init__(
        self, enabled: bool, total: int | None, initial: int = 0, *, num_engines: int = 1, verbose: bool = False
    ) -> None:
        super().__init__(enabled, total, initial)
        self.engine_pids: list[list[int]] = [[] for _ in range(num_engines)]  # in order; a second: Ray restarted it
        self.engine_tokens = [0] * num_engines
        self.engine_ranges = [0] * num_engines
        self.engine_busy_s = [0.0] * num_engines  # in run_range; well under the job's time: it waited on the driver
        self._counted: dict[int, tuple[int, int]] = {}  # running range -> (prompts, tokens) counted so far
        self._engine_bars = (
            [
                tqdm(
                    unit="tok",
                    unit_scale=True,
                    desc=f"engine {i}",
                    position=i + 1,
                    file=sys.stderr,
                    dynamic_ncols=True,
                    leave=False,
                )
                for i in range(num_engines)
            ]
            if enabled and verbose
            else []
        )

    def range_started(self, number: int) -> None:
        self._counted[number] = (0, 0)

    def range_progress(self, engine: int, number: int, num_prompts: int, num_tokens: int) -> None:
        """Count what `engine` says it has forwarded of range `number`; a report after the range ended is dropped."""
        counted = self._counted.get(number)
        if counted is not None:
            self._count(engine, number, max(num_prompts, counted[0]), max(num_tokens, counted[1]))

    def range_done(
        self, engine: int, number: int, num_prompts: int, num_tokens: int, pid: int, elapsed_s: float = 0.0
    ) -> None:
        """Count the rest of range `number`, which `engine` (in process `pid`) finished in `elapsed_s`."""
        self._count(engine, number, num_prompts, num_tokens)
        del self._counted[number]
        if pid not in self.engine_pids[engine]:
            self.engine_pids[engine].append(pid)
        self.engine_ranges[engine] += 1
        self.engine_busy_s[engine] += elapsed_s
        if self._engine_bars:
            self._engine_bars[engine].set_postfix_str(self._engine_state(engine), refresh=False)

    def _count(self, engine: int, number: int, num_prompts: int, num_tokens: int) -> None:
        """Move the bars up to (num_prompts, num_tokens) of range `number`."""
        old_prompts, old_tokens = self._counted[number]
        new_prompts, new_tokens = num_prompts - old_prompts, num_tokens - old_tokens
        if new_prompts <= 0 and new_tokens <= 0:
            return
        self._counted[number] = (num_prompts, num_tokens)
        self.update(new_prompts, new_tokens)
        self.engine_tokens[engine] += new_tokens
        if self._engine_bars:
            self._engine_bars[engine].update(new_tokens)

    def _engine_state(self, engine: int) -> str:
        pids = self.engine_pids[engine]
        restarts = f", {len(pids) - 1} restarts" if len(pids) > 1 else ""
        busy = f"busy {self.engine_busy_s[engine]:.1f} s"
        return f"{self.engine_ranges[engine]} ranges, {busy}, pid {pids[-1] if pids else '?'}{restarts}"

    def close(self, summary: ExtractionSummary | None = None) -> None:
        for bar in self._engine_bars:
            bar.close()
        if self._engine_bars:  # the bars vanish when closed: leave each engine's exact count behind
            for engine, num_tokens in enumerate(self.engine_tokens):
                print(f"engine {engine}: {num_tokens} tokens, {self._engine_state(engine)}", file=sys.stderr)
        super().close(summary)
