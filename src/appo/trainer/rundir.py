"""The run directory policy: a new run never writes into an old run's directory.

`appo train` (`trainer.default_local_dir`) and `appo sft` (`sft.output_dir`) write
checkpoints and `metrics.jsonl` into one directory. `prepare_run_dir` decides, before the
run touches anything:

- no directory configured (the default): a new unique one, `runs/<kind>-YYYYmmdd-HHMMSS`
  (`-2`, `-3`, ... when two runs start in the same second);
- `trainer.resume=true`: the directory must be named; leftovers of an interrupted save
  are recovered (`appo.fsutil.recover_leftovers`) and the run continues there;
- a new run into a non-empty directory: refused with one line naming the three ways on
  (resume, a new directory, `trainer.overwrite=true`);
- `trainer.overwrite=true`: the old run is renamed aside and deleted, but only if the
  directory looks like an appo run, so a mistyped path (`.`, a home directory) is never
  emptied.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from appo.errors import AppoError
from appo.fsutil import atomic_write_text, recover_leftovers, write_error

RUN_MARKER = "run.json"
_RUN_ENTRIES = ("metrics.jsonl", "latest", RUN_MARKER)


def unique_run_dir(kind: str, parent: str | Path = "runs", now: float | None = None) -> Path:
    """`parent/<kind>-YYYYmmdd-HHMMSS`, with a numeric suffix if that name is taken."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    base = Path(parent) / f"{kind}-{stamp}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def looks_like_run(path: Path) -> bool:
    """A directory appo wrote: a run marker, metrics or checkpoints (also half-written)."""
    if any((path / name).exists() for name in _RUN_ENTRIES):
        return True
    return any(p.name.startswith(("global_step_", ".tmp_global_step_", ".old_global_step_"))
               for p in path.iterdir())


def prepare_run_dir(configured: str | None, kind: str, key: str, *, resume: bool = False,
                    overwrite: bool = False, resumable: bool = True) -> Path:
    """Apply the policy (module docstring) and return the directory, created. `kind` names
    the default directory (`appo`, `sft`); `key` is the config key users set it with."""
    if not configured:
        if resume:
            raise AppoError(f"trainer.resume=true needs {key}=DIR naming the run to continue")
        path = unique_run_dir(kind)
    else:
        path = Path(configured)
    if path.exists() and not path.is_dir():
        raise AppoError(f"{key}={path} is a file, not a directory")
    if resume and path.is_dir():
        for note in recover_leftovers(path):
            print(f"appo: {path}: {note}")
    elif path.is_dir() and any(path.iterdir()):
        if not overwrite:
            ways = "continue it with trainer.resume=true, " if resumable else ""
            raise AppoError(f"run directory {path} is not empty (a previous run?): {ways}"
                            f"choose a new {key}, or replace it with trainer.overwrite=true")
        _remove_old_run(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not (path / RUN_MARKER).exists():
            atomic_write_text(path / RUN_MARKER, json.dumps(
                {"kind": kind, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
    except OSError as e:
        raise write_error(e, path, "create run directory") from None
    return path


def _remove_old_run(path: Path) -> None:
    if not looks_like_run(path):
        raise AppoError(f"trainer.overwrite=true will not empty {path}: it holds no appo run "
                        "(no run.json, metrics.jsonl or checkpoints); choose another directory")
    # Rename first: a kill during the (slow) delete must not leave a half-emptied run dir.
    aside = path.with_name(f".replaced_{path.name}_{os.getpid()}")
    try:
        os.replace(path, aside)
    except OSError as e:
        raise write_error(e, path, "replace run directory") from None
    shutil.rmtree(aside, ignore_errors=True)
    print(f"appo: trainer.overwrite=true: removed the previous run in {path}")


def new_directories(configured: str | None) -> list[Path]:
    """The directories that do not exist yet on the way to the run directory for
    `configured`, deepest first; for the default (None) those above the unique directory,
    which is itself always new."""
    target = Path(configured) if configured else Path("runs") / "new-run"
    missing = [d for d in (target, *target.parents) if not d.exists()]
    return missing if configured else [d for d in missing if d != target]


def discard_unused_run_dir(path: Path, new_dirs: list[Path]) -> None:
    """After a new run failed while starting: remove its run marker and the directories
    it created (`new_directories`, taken before), if nothing else was written there."""
    try:
        if any(p.name != RUN_MARKER for p in path.iterdir()):
            return  # the run wrote something: it stays
        (path / RUN_MARKER).unlink(missing_ok=True)
    except OSError:
        return
    for d in new_dirs:  # deepest first; stop at the first that is not empty
        try:
            d.rmdir()
        except OSError:
            break


def agree_run_dir(t, dp) -> tuple[Path, list[Path]]:
    """The RL run's directory under `trainer.*` (`t`): rank 0 applies the policy
    (`prepare_run_dir`), every rank of `dp` takes its answer (the collective is also the
    barrier before any rank reads the directory). Returns it and the directories this run
    creates (`new_directories`, the run directory first when it is a new unique one)."""
    decision: str | AppoError | None = None
    new_dirs = new_directories(t.default_local_dir)
    if dp.is_main:
        try:
            decision = str(prepare_run_dir(t.default_local_dir, "appo",
                                           "trainer.default_local_dir", resume=t.resume,
                                           overwrite=t.overwrite))
        except AppoError as e:
            decision = e
    decision = dp.gather_objects([decision] if dp.is_main else [])[0]
    if isinstance(decision, AppoError):
        raise decision
    if dp.is_main:
        print(f"appo: run directory {decision}", flush=True)
    if not t.default_local_dir:  # the new unique directory
        new_dirs.insert(0, Path(str(decision)))
    return Path(str(decision)), new_dirs
