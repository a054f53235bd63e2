"""The run directory policy: a new run never writes into an old run's directory, and one
process owns a run directory at a time.

`appo train` (`trainer.default_local_dir`) and `appo sft` (`sft.output_dir`) write
checkpoints and `metrics.jsonl` into one directory. `open_run_dir` decides, before the
run touches anything:

- no directory configured (the default): a new unique one, `runs/<kind>-YYYYmmdd-HHMMSS`
  (`-2`, `-3`, ... when two runs start in the same second);
- the directory is locked for the process (`appo.outdir.lock_dir`): a second process on it
  (two `trainer.resume=true`, or `trainer.overwrite=true` during a live run) is refused
  with one line naming the holder's pid;
- `trainer.resume=true`: the directory must be named; leftovers of an interrupted save
  are recovered (`appo.fsutil.recover_leftovers`) and the run continues there;
- a new run into a non-empty directory: refused with one line that says what is there
  (checkpoints, or a run that saved none) and the ways on (resume, a new directory,
  `trainer.overwrite=true`);
- `trainer.overwrite=true`: only a directory that looks like an appo run (a mistyped `.`
  or home directory is never emptied); the old run is renamed aside, and deleted only
  once the new run has started (`RunDir.started`, after the start-up checks); a start
  that fails puts it back (`RunDir.failed`).

A new run that fails before it saved anything (while starting, or in its first step)
removes what it created (`RunDir.failed`), so the same command can simply be run again;
one that logged steps but saved no checkpoint stays, and the rerun's refusal says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from appo.errors import AppoError
from appo.fsutil import atomic_write_text, recover_leftovers, write_error
from appo.outdir import LOCK_NAME, DirLock, lock_dir, outputs_in

RUN_MARKER = "run.json"
METRICS = "metrics.jsonl"
_RUN_ENTRIES = (METRICS, "latest", RUN_MARKER)
ASIDE_PREFIX = ".replaced_"
_KEPT: list[RunDir] = []  # run directories held for the life of the process (prepare_run_dir)


def unique_run_dir(kind: str, parent: str | Path = "runs", now: float | None = None) -> Path:
    """`parent/<kind>-YYYYmmdd-HHMMSS`, with a numeric suffix if that name is taken."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    base = Path(parent) / f"{kind}-{stamp}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def _checkpoints(path: Path) -> list[Path]:
    return sorted(p for p in path.glob("global_step_*") if p.is_dir())


def looks_like_run(path: Path) -> bool:
    """A directory appo wrote: a run marker, metrics or checkpoints (also half-written)."""
    if any((path / name).exists() for name in _RUN_ENTRIES):
        return True
    return any(p.name.startswith(("global_step_", ".tmp_global_step_", ".old_global_step_"))
               for p in path.iterdir())


def _metric_rows(path: Path) -> int:
    try:
        return sum(1 for line in (path / METRICS).read_text().splitlines() if line.strip())
    except (OSError, UnicodeDecodeError):
        return 0


def describe_run(path: Path) -> str:
    """What a non-empty run directory holds, in words, for a refusal."""
    ckpts = _checkpoints(path)
    if ckpts:
        return f"a previous run: {len(ckpts)} checkpoint(s), the last {ckpts[-1].name}"
    if looks_like_run(path):
        rows = _metric_rows(path)
        logged = f"metrics of {rows} step(s)" if rows else "no metrics"
        return f"a run that saved no checkpoint ({logged}), so it cannot be resumed"
    names = [p.name for p in outputs_in(path)]
    return (f"{len(names)} entries that are not an appo run, e.g. {names[0]}"
            if names else "nothing but a lock file")


@dataclass
class RunDir:
    """A run directory this process owns (rank 0; other ranks get `owner=False`)."""

    path: Path
    new_dirs: list[Path] = field(default_factory=list)  # created for this run, deepest first
    lock: DirLock | None = None
    aside: Path | None = None  # the run `overwrite` replaces, until this one has started
    resume: bool = False
    dumps_lock: DirLock | None = None  # trainer.rollout_data_dir, while this run writes there

    @property
    def owner(self) -> bool:
        return self.lock is not None

    def started(self) -> None:
        """The start-up checks passed: the replaced run is deleted now."""
        if self.aside is not None:
            shutil.rmtree(self.aside, ignore_errors=True)
            self.aside = None
            print(f"appo: trainer.overwrite=true: removed the previous run in {self.path}")

    def failed(self) -> None:
        """The run failed before it saved a checkpoint: remove what it created when it holds
        nothing of value (only the run marker, an empty metrics file, the lock), and put a
        run it was replacing back."""
        if not self.owner or self.resume:
            return
        if self.aside is not None:  # still starting: nothing of the new run is worth keeping
            shutil.rmtree(self.path, ignore_errors=True)
            os.replace(self.aside, self.path)  # the old lock file (ours) comes back with it
            self.aside = None
            print(f"appo: the new run did not start; the previous run in {self.path} is kept")
            return
        if _checkpoints(self.path):
            return
        discard_unused_run_dir(self.path, self.new_dirs)

    def release(self) -> None:
        if self.dumps_lock is not None:
            self.dumps_lock.release()
        if self.lock is not None:
            self.lock.release()

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """Around a run's start-up: `started()` after it, `failed()` if it raises."""
        try:
            yield
        except BaseException:
            self.failed()
            raise
        self.started()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Around the training loop: `failed()` if it raises (which keeps a run that has a
        checkpoint or logged steps)."""
        try:
            yield
        except BaseException:
            self.failed()
            raise


def open_run_dir(configured: str | None, kind: str, key: str, *, resume: bool = False,
                 overwrite: bool = False, resumable: bool = True) -> RunDir:
    """Apply the policy (module docstring): the directory, created and locked. `kind` names
    the default directory (`appo`, `sft`); `key` is the config key users set it with."""
    if not configured:
        if resume:
            raise AppoError(f"trainer.resume=true needs {key}=DIR naming the run to continue")
        path = unique_run_dir(kind)
    else:
        path = Path(configured)
    if path.exists() and not path.is_dir():
        raise AppoError(f"{key}={path} is a file, not a directory")
    new_dirs = [d for d in (path, *path.parents) if not d.exists()]
    run = RunDir(path, new_dirs, resume=resume)
    had_lock_file = (path / LOCK_NAME).exists()
    run.lock = lock_dir(path, "run directory")
    # Under the lock, an aside copy is no live overwrite's: one that was killed while starting.
    for old in sorted(path.parent.glob(f"{ASIDE_PREFIX}{path.name}_*")):
        print(f"appo: note: {old} holds the run that an interrupted trainer.overwrite=true "
              f"was replacing; move it back to {path}, or delete it", file=sys.stderr)
    try:
        _decide(run, key, overwrite, resumable)
        if not (path / RUN_MARKER).exists():
            atomic_write_text(path / RUN_MARKER, json.dumps(
                {"kind": kind, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
    except OSError as e:
        run.failed()
        run.release()
        raise write_error(e, path, "create run directory") from None
    except BaseException:
        if not had_lock_file and not run.aside:  # a refusal leaves the directory as it was
            (path / LOCK_NAME).unlink(missing_ok=True)
        run.release()
        raise
    return run


def _decide(run: RunDir, key: str, overwrite: bool, resumable: bool) -> None:
    path = run.path
    if run.resume:
        for note in recover_leftovers(path):
            print(f"appo: {path}: {note}")
        return
    if not outputs_in(path):
        return
    if not overwrite:
        ways = ("continue it with trainer.resume=true, "
                if resumable and _checkpoints(path) else "")
        raise AppoError(f"run directory {path} is not empty ({describe_run(path)}): {ways}"
                        f"choose a new {key}, or replace it with trainer.overwrite=true")
    if not looks_like_run(path):
        raise AppoError(f"trainer.overwrite=true will not empty {path}: it holds no appo run "
                        "(no run.json, metrics.jsonl or checkpoints); choose another directory")
    # Renamed, not deleted: the new run may still fail to start, and a kill during the
    # (slow) delete must not leave a half-emptied run directory.
    aside = path.with_name(f"{ASIDE_PREFIX}{path.name}_{os.getpid()}")
    shutil.rmtree(aside, ignore_errors=True)
    try:
        os.replace(path, aside)
    except OSError as e:
        raise write_error(e, path, "replace run directory") from None
    run.aside = aside
    old = run.lock
    try:
        run.lock = lock_dir(path, "run directory")  # the new, empty directory
    except BaseException:
        run.lock = old
        os.replace(aside, path)
        run.aside = None
        raise
    if old is not None:
        old.release()  # the aside copy's lock: nobody else can reach it by name


def prepare_run_dir(configured: str | None, kind: str, key: str, *, resume: bool = False,
                    overwrite: bool = False, resumable: bool = True) -> Path:
    """`open_run_dir` for callers with no start-up to wait for: an old run replaced by
    `overwrite` is deleted at once. The lock is held until the process ends."""
    run = open_run_dir(configured, kind, key, resume=resume, overwrite=overwrite,
                       resumable=resumable)
    run.started()
    _KEPT.append(run)  # the lock lives as long as its `DirLock`: here, the process
    return run.path


def discard_unused_run_dir(path: Path, new_dirs: list[Path]) -> None:
    """After a new run failed before saving anything: remove its run marker, an empty
    metrics file, the lock file and the directories it created (`new_dirs`, deepest first),
    if nothing else was written there."""
    removable = {RUN_MARKER, LOCK_NAME}
    if _metric_rows(path) == 0:
        removable.add(METRICS)
    try:
        if any(p.name not in removable for p in path.iterdir()):
            return  # the run wrote something: it stays
        for name in removable:
            (path / name).unlink(missing_ok=True)
    except OSError:
        return
    for d in new_dirs:  # deepest first; stop at the first that is not empty
        try:
            d.rmdir()
        except OSError:
            break


def agree_run_dir(t, dp) -> RunDir:
    """The RL run's directory under `trainer.*` (`t`): rank 0 applies the policy
    (`open_run_dir`), every rank of `dp` takes its answer (the collective is also the
    barrier before any rank reads the directory); other ranks get a `RunDir` they do not
    own."""
    decision: str | AppoError | None = None
    run: RunDir | None = None
    if dp.is_main:
        try:
            run = open_run_dir(t.default_local_dir, "appo", "trainer.default_local_dir",
                               resume=t.resume, overwrite=t.overwrite)
            if t.rollout_data_dir:  # two runs dumping into one directory mix their steps
                run.dumps_lock = lock_dir(t.rollout_data_dir,
                                          "rollout dump directory (trainer.rollout_data_dir)")
            decision = str(run.path)
        except AppoError as e:
            if run is not None:  # refused after the run directory was opened: undo that
                run.failed()
                run.release()
            decision = e
    decision = dp.gather_objects([decision] if dp.is_main else [])[0]
    if isinstance(decision, AppoError):
        raise decision
    if dp.is_main:
        print(f"appo: run directory {decision}", flush=True)
    return run if run is not None else RunDir(Path(str(decision)), resume=t.resume)
