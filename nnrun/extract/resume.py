"""Where a job goes on in an existing folder, and its input from there.

A job builds on the shards a folder holds only after checking them (verify.py) and checking
that the input's first `num_consumed` records are those the folder was made from (their running
hash, identity.InputHasher). Then:
- an incomplete folder goes on after its last intact shard;
- a complete folder whose input has items appended goes on from its last shard: that shard was
  closed only because the old input ended, and an uninterrupted run over the longer input
  would have filled it further, so it is redone (plan.py: a layout that restarts right after a
  shard's last prompt is the uninterrupted one);
- a complete folder re-run with the same input has nothing to do;
- any other input is refused, as it would mix two inputs in one folder.
A damaged shard is redone with every shard after it, and a FolderRepairWarning names it.
Cutting a folder back is a commit like any other: the shorter manifest is saved before any shard
file is deleted, so a kill at any point leaves a folder that resumes to the same bytes.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from pathlib import Path

from nnrun.extract.folder import remove_uncommitted
from nnrun.extract.identity import InputHasher
from nnrun.extract.inputs import PromptRecord, PromptSource
from nnrun.extract.manifest import Manifest, SettingsMismatchError
from nnrun.extract.plan import HashedRecords
from nnrun.extract.shards import shard_file_name
from nnrun.extract.verify import Damage, DamagedFolderError, find_damage


class FolderRepairWarning(UserWarning):
    """A job found damaged shards in its folder and redoes them (and every shard after them)."""


def continue_folder(out_dir: Path, manifest: Manifest, source: PromptSource) -> HashedRecords | None:
    """Cut `manifest` back to where the job goes on and return the input from there; None: nothing to do."""
    damage = find_damage(out_dir, manifest)
    if any(d.shard is None for d in damage):
        raise DamagedFolderError(out_dir, damage)
    num_kept = min((d.shard for d in damage), default=len(manifest.shards))
    if manifest.is_complete:
        num_kept = max(0, min(num_kept, len(manifest.shards) - 1))  # the last shard grows if the input did
    start = _restart_index(manifest, num_kept)
    records, has_more = _read_input(out_dir, manifest, source, start)
    if manifest.is_complete and not damage and not has_more:
        return None
    if damage:
        _warn_redo(out_dir, manifest, damage, num_kept)
    if num_kept < len(manifest.shards) or manifest.is_complete:
        manifest.rewind(num_kept, start, records.hasher.hexdigest() if start else "")
        manifest.save(out_dir)  # first the commit, then the files it no longer lists
        remove_uncommitted(out_dir, manifest)
    return records


def _restart_index(manifest: Manifest, num_kept: int) -> int:
    """The input record after the first `num_kept` shards' last prompt (all shards kept: after everything)."""
    if num_kept == len(manifest.shards):
        return manifest.num_consumed
    num_rows = sum(shard.num_prompts for shard in manifest.shards[:num_kept])
    return manifest.prompts["index"][num_rows - 1] + 1 if num_rows else 0


def _read_input(out_dir: Path, manifest: Manifest, source: PromptSource, start: int) -> tuple[HashedRecords, bool]:
    """The input from record `start` once its first `num_consumed` records proved to be the folder's; and
    whether any record follows those.

    One pass, as an iterable input may be a generator: the records from `start` to `num_consumed`
    are read to finish the check and handed out again. They are the records of the shards being
    redone, so holding them costs no more than redoing them.
    """
    records = iter(source.records())
    hasher = InputHasher()
    _hash(hasher, itertools.islice(records, start))
    at_start = hasher.copy()
    replay = list(itertools.islice(records, manifest.num_consumed - start))
    _hash(hasher, replay)
    is_same = hasher.num_records == manifest.num_consumed and (
        manifest.num_consumed == 0 or hasher.hexdigest() == manifest.input_sha256
    )
    if not is_same:
        raise SettingsMismatchError(_other_input_message(out_dir, manifest, hasher.num_records))
    following = list(itertools.islice(records, 1))
    return HashedRecords(itertools.chain(replay, following, records), at_start), bool(following)


def _hash(hasher: InputHasher, records: Iterator[PromptRecord] | list[PromptRecord]) -> None:
    for record in records:
        hasher.update(record.prompt, record.error)


def _other_input_message(out_dir: Path, manifest: Manifest, num_read: int) -> str:
    num = manifest.num_consumed
    what = (
        f"this input has only {num_read} items"
        if num_read < num
        else f"the first {num} items of this input differ from them"
    )
    return (
        f"{out_dir} was made from {num} input items and {what}. A folder goes on only with the input it was "
        "made from, or that input with items appended at its end (then the folder is extended). Re-run with "
        f"that input, or extract into a new folder (CLI: a new --out folder), or delete {out_dir} first"
    )


def _warn_redo(out_dir: Path, manifest: Manifest, damage: list[Damage], num_kept: int) -> None:
    problems = "; ".join(d.message() for d in damage)
    warnings.warn(
        f"{out_dir} is damaged: {problems}. Keeping its first {num_kept} of {len(manifest.shards)} "
        f"shards and redoing it from {shard_file_name(num_kept)} on",
        FolderRepairWarning,
        stacklevel=2,
    )
