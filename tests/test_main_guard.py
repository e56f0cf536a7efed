"""Which lines of a script spawn's children re-run: the check tensor parallelism makes before any rank starts."""

import textwrap

import pytest

from nnrun.tp.main_guard import MainGuardError, check_main_guard, is_guarded

SCRIPT = """\
import nnrun

def build():
    return nnrun.LLM("tiny-facts", tensor_parallel_size=2)

llm = build()

if __name__ == "__main__":
    llm = build()
else:
    llm = build()

try:
    if "__main__" == __name__ and True:
        llm = build()
except ImportError:
    pass

if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize(
    "line, expected",
    [
        (4, False),  # a function body runs where it is called from
        (6, False),  # the top level: every child re-runs it
        (9, True),
        (11, False),  # the guard's else branch is what children run
        (15, True),  # a guard inside try, spelled the other way round, inside an `and`
        (20, True),
    ],
)
def test_lines_under_the_main_guard(tmp_path, line, expected):
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    assert is_guarded(str(path), line) is expected


def test_unreadable_script_is_not_judged(tmp_path):
    assert is_guarded(str(tmp_path / "missing.py"), 1) is None
    (tmp_path / "broken.py").write_text("def (:\n")
    assert is_guarded(str(tmp_path / "broken.py"), 1) is None


def test_a_spawned_childs_rerun_of_the_top_level_refuses(tmp_path):
    code = compile(
        textwrap.dedent("""
        from nnrun.tp.main_guard import check_main_guard
        check_main_guard()
        """),
        str(tmp_path / "script.py"),
        "exec",
    )
    with pytest.raises(MainGuardError, match=r'script.py, line 3.*under `if __name__ == "__main__":`'):
        exec(code, {"__name__": "__mp_main__"})  # as spawn runs the main script in a child


def test_pytest_itself_is_guarded():
    check_main_guard()  # pytest's entry point keeps its top level under the guard: nothing to refuse
