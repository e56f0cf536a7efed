"""The notebooks run top to bottom in a real Jupyter kernel on the bundled model and write their figures."""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

REPO_DIR = Path(__file__).resolve().parent.parent
NOTEBOOKS_DIR = REPO_DIR / "notebooks"
NOTEBOOKS = sorted(path.name for path in NOTEBOOKS_DIR.glob("*.ipynb"))
NOTEBOOK_TO_FIGURES = {
    "01_quickstart.ipynb": ["01_edit_next_token.png"],
    "02_activation_patching.ipynb": ["02_patching_heatmap.png"],
    "03_logit_lens.ipynb": ["03_logit_lens.png", "03_answer_by_block.png"],
    "04_steering.ipynb": ["04_steering_by_scale.png"],
    "05_extract_and_probe.ipynb": ["05_probe_accuracy.png", "05_country_confusion.png"],
    "06_shared_server.ipynb": ["06_registered_steering.png"],
}
NOTEBOOKS_NEEDING_A_SERVER = {"06_shared_server.ipynb"}
CELL_TIMEOUT_S = 300
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def python3_kernel(tmp_path_factory):
    """A "python3" kernelspec that runs this interpreter, first on JUPYTER_PATH.

    A user-level or system "python3" kernelspec may point at another Python without nnrun; the
    kernel also gets the repository on PYTHONPATH and inherits HF_HUB_OFFLINE from conftest.
    """
    jupyter_dir = tmp_path_factory.mktemp("jupyter")
    spec_dir = jupyter_dir / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (nnrun tests)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JUPYTER_PATH", os.pathsep.join(filter(None, [str(jupyter_dir), os.environ.get("JUPYTER_PATH")])))
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_DIR), os.environ.get("PYTHONPATH")])))
        patch.setenv("MPLBACKEND", "agg")
        yield "python3"


def test_every_notebook_is_listed_here():
    assert NOTEBOOKS == sorted(NOTEBOOK_TO_FIGURES)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_committed_clean_and_starts_with_the_model(name):
    notebook = nbformat.read(NOTEBOOKS_DIR / name, as_version=4)
    nbformat.validate(notebook)
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(not cell.outputs and cell.execution_count is None for cell in code_cells), "clear the outputs"
    assert notebook.cells[0].cell_type == "markdown", "open with a short introduction"
    assert 'MODEL = "tiny-facts"' in code_cells[0].source


@pytest.fixture(scope="module")
def serve_url():
    """`nnrun serve tiny-facts` on 127.0.0.1 (a free port, with a key) for the notebooks that talk to one."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    sys.path.insert(0, str(REPO_DIR / "tests" / "serve"))  # the serve tests' helpers start and stop it
    from serve_helpers import API_KEY, ServerProcess

    server = ServerProcess("--request-timeout", "120")
    try:
        yield server.wait_ready().url, API_KEY
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_and_writes_its_figures(name, python3_kernel, tmp_path, request, monkeypatch):
    if name in NOTEBOOKS_NEEDING_A_SERVER:  # the kernel inherits these; the notebook reads them
        url, api_key = request.getfixturevalue("serve_url")
        monkeypatch.setenv("NNRUN_SERVE_URL", url)
        monkeypatch.setenv("NNRUN_API_KEY", api_key)
    shutil.copy(NOTEBOOKS_DIR / name, tmp_path / name)  # figures/ and activations/ land in the copy's folder
    notebook = nbformat.read(tmp_path / name, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=CELL_TIMEOUT_S, kernel_name=python3_kernel, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error
    for figure in NOTEBOOK_TO_FIGURES[name]:
        path = tmp_path / "figures" / figure
        assert path.is_file(), f"{name} did not write figures/{figure}"
        assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000, path
