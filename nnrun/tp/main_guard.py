"""Refuse to start rank processes from a script's unguarded top level, at once and in one sentence.

Rank processes start with Python's "spawn", which re-runs the main script in each child before
the child does anything else. A script that builds a tensor-parallel engine at its top level,
outside `if __name__ == "__main__":`, makes every child build one too: the child dies in its
bootstrap and the front end would only see a rank exiting while loading its shard. So before any
rank starts, the front end finds the line of the main script that is running now and checks, in
the script's own syntax tree, that it sits under the guard; a child that re-runs an unguarded
script refuses the same way (in case the parent could not read its script).
"""

from __future__ import annotations

import ast
import os
import sys
from types import FrameType

_SPAWN_MAIN = "__mp_main__"  # the name spawn gives the main script it re-runs in a child


class MainGuardError(RuntimeError):
    """Tensor parallelism was started from a script's top level without `if __name__ == "__main__":`."""


def check_main_guard() -> None:
    """Raise MainGuardError when spawned ranks would re-run the code that is starting them."""
    frame = _top_level_frame(_SPAWN_MAIN)
    if frame is not None:  # this is a rank's bootstrap re-running the unguarded script
        raise MainGuardError(_message(frame.f_code.co_filename, frame.f_lineno))
    main = sys.modules.get("__main__")
    path = _rerun_path(main)
    frame = _top_level_frame("__main__")
    if path is None or frame is None or not _same_file(frame.f_code.co_filename, path):
        return  # spawn re-runs nothing, or the running top level is not the script's (a notebook cell's)
    if is_guarded(path, frame.f_lineno) is False:
        raise MainGuardError(_message(path, frame.f_lineno))


def is_guarded(path: str, line: int) -> bool | None:
    """Whether `line` of the script at `path` lies under `if __name__ == "__main__":` (None: unreadable)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None
    return _guarded_in(tree.body, line)


def _message(path: str, line: int) -> str:
    return (
        f"{path}, line {line}, starts tensor parallelism at the script's top level, which every rank "
        'process re-runs as it starts (Python\'s spawn): put that code under `if __name__ == "__main__":`'
    )


def _rerun_path(main: object) -> str | None:
    """The file spawn re-runs in each child as it starts (multiprocessing.spawn's rules), or None."""
    path = getattr(main, "__file__", None)
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if path is None or (spec_name or "").endswith("__main__"):  # `python -c`, a notebook, `python -m package`
        return None
    return path


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _top_level_frame(module_name: str) -> FrameType | None:
    """The frame of a module's top-level code named `module_name` on this thread's stack, if any."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == module_name:
            return frame
        frame = frame.f_back
    return None


def _guarded_in(body: list[ast.stmt], line: int) -> bool:
    """Whether `line` is inside a main guard among `body`'s statements (descending into if/try/with/for/while)."""
    for stmt in body:
        if not stmt.lineno <= line <= (stmt.end_lineno or stmt.lineno):
            continue
        if isinstance(stmt, ast.If) and _is_main_test(stmt.test):
            return any(s.lineno <= line <= (s.end_lineno or s.lineno) for s in stmt.body)
        children = [
            getattr(stmt, name, [])
            for name in ("body", "orelse", "finalbody")
            if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        ]
        children += [handler.body for handler in getattr(stmt, "handlers", [])]
        return any(_guarded_in(child, line) for child in children)
    return False


def _is_main_test(test: ast.expr) -> bool:
    """`__name__ == "__main__"` (either way round, possibly inside an `and`)."""
    for node in ast.walk(test):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
            sides = [node.left, *node.comparators]
            has_name = any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            has_main = any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides)
            if has_name and has_main:
                return True
    return False
