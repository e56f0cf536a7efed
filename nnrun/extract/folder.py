"""Open an output folder for a job: claim a new one, or check an existing one was made with the same settings.

What an existing folder holds is checked next, by resume.py, before the job builds on it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from nnrun.extract.manifest import MANIFEST_NAME, Manifest, SettingsMismatchError, settings_diff

_SHARD_GLOB = "shard-*.safetensors"


def open_folder(out_dir: Path, settings: dict[str, Any], model_info: dict[str, Any], resume: bool) -> Manifest:
    """The folder's manifest, new (and saved at once, so the settings are claimed) or resumed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = Manifest.load(out_dir)
    if manifest is None:
        others = sorted(p.name for p in out_dir.iterdir() if not _is_uncommitted(p))
        if others:
            raise ValueError(
                f"{out_dir} is not empty ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}) "
                "and holds no extraction; choose a new or empty folder"
            )
        manifest = Manifest(settings=settings, model=model_info)
        remove_uncommitted(out_dir, manifest)
        manifest.save(out_dir)
        return manifest
    if not resume:
        raise FileExistsError(
            f"{out_dir} already holds an extraction; pass resume=True (CLI: leave out "
            "--no-resume) to continue it, or choose another folder"
        )
    diffs = settings_diff(manifest.settings, settings)
    if diffs:
        raise SettingsMismatchError(
            f"{out_dir} holds an extraction made with other settings, and continuing would mix them: "
            f"{'; '.join(diffs)}. Re-run with the stored settings, or choose another folder"
        )
    remove_uncommitted(out_dir, manifest)
    return manifest


@contextmanager
def claim_folder(
    out_dir: Path, settings: dict[str, Any], model_info: dict[str, Any], resume: bool
) -> Iterator[Manifest]:
    """`open_folder`'s manifest for the job's block; a new folder's claim is undone when the block fails having
    stored nothing, so that the corrected re-run (other settings, e.g. --text-field) is not refused."""
    had_folder, is_new = out_dir.exists(), not (out_dir / MANIFEST_NAME).exists()
    manifest = open_folder(out_dir, settings, model_info, resume)
    try:
        yield manifest
    except BaseException:
        if is_new and not manifest.shards and not manifest.num_consumed:
            _release(out_dir, manifest, had_folder)
        raise


def _release(out_dir: Path, manifest: Manifest, had_folder: bool) -> None:
    """Remove the manifest (its settings are all it holds), and the folder if the job created it and it is empty."""
    remove_uncommitted(out_dir, manifest)
    (out_dir / MANIFEST_NAME).unlink(missing_ok=True)
    if not had_folder and not any(out_dir.iterdir()):
        out_dir.rmdir()


def remove_uncommitted(out_dir: Path, manifest: Manifest) -> None:
    """Delete temp files and shards written after the last manifest update (a killed job's leftovers)."""
    committed = {shard.file for shard in manifest.shards}
    for path in out_dir.iterdir():
        if _is_uncommitted(path) and path.name not in committed:
            path.unlink()


def _is_uncommitted(path: Path) -> bool:
    # Never the manifest itself: it is only ever replaced whole, so the folder always has one.
    return path.name.endswith(".tmp") or path.match(_SHARD_GLOB)
