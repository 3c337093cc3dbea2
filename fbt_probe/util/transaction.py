"""One output transaction per command: everything a command writes goes into a staging
folder beside its destination and is moved into place at the end, replacing an earlier run's
outputs only when asked (``--force``); a failure or a signal at any point leaves the
destination as it was. Every analysis's verb, ``report``, ``view``'s page, ``seeds merge``
and ``reproduce`` write through it (``probes.analysis.Analysis`` for the analyses)."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from fbt_probe.util.files import check_output_dir, claim, temp_names, without_umask


def existing_outputs(out: Path, outputs: tuple[str, ...]) -> list[Path]:
    """What is in ``out`` under the names a command writes (``outputs``: glob patterns,
    relative to ``out``, at most one folder deep: ``figures/lens_*`` is a file of a shared
    figure folder, ``tuned_lens`` a folder of the command's own)."""
    out = Path(out)
    if not out.is_dir():
        return []
    return sorted({p for pattern in outputs for p in out.glob(pattern)})


def _units(stage: Path, outputs: tuple[str, ...]) -> list[str]:
    """What a command wrote into ``stage``, as the paths moved one by one: an entry whole, or
    the entries of a folder that other commands share (one an output pattern reaches into)."""
    shared = {pattern.split("/", 1)[0] for pattern in outputs if "/" in pattern}
    units = []
    for entry in sorted(stage.iterdir()):
        if entry.name in shared and entry.is_dir() and not entry.is_symlink():
            units += [f"{entry.name}/{p.name}" for p in sorted(entry.iterdir())]
        else:
            units.append(entry.name)
    return units


def _commit(stage: Path, out: Path, outputs: tuple[str, ...]) -> None:
    """Move what ``stage`` holds into ``out``: everything of an earlier run under ``outputs``
    (a stale file this run did not write included) is set aside first, and put back if any
    move fails or a signal lands, so that ``out`` ends as it was or as this run wrote it."""
    staged = _units(stage, outputs)
    earlier = {str(p.relative_to(out)) for p in existing_outputs(out, outputs)}
    earlier |= {u for u in staged if (out / u).exists() or (out / u).is_symlink()}
    aside = stage.parent / ".old"
    made, moved_aside, moved_in = [], [], []
    try:
        os.mkdir(aside, 0o700)
        for unit in sorted(earlier):
            (aside / unit).parent.mkdir(parents=True, exist_ok=True)
            os.replace(out / unit, aside / unit)
            moved_aside.append(unit)
        for unit in staged:
            for parent in reversed((out / unit).relative_to(out.parent).parents[:-1]):
                if not (out.parent / parent).exists():
                    os.mkdir(out.parent / parent)
                    made.append(out.parent / parent)
            os.replace(stage / unit, out / unit)
            moved_in.append(unit)
    except BaseException:
        for unit in reversed(moved_in):
            os.replace(out / unit, stage / unit)
        for unit in reversed(moved_aside):
            os.replace(aside / unit, out / unit)
        for folder in reversed(made):
            folder.rmdir()
        raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)


@contextmanager
def transaction(out: Path, outputs: tuple[str, ...], force: bool = False, flag: str = "--out"):
    """Write a command's outputs as one transaction: claim ``out`` (one writer), refuse an
    earlier run's outputs there without ``force``, and yield a staging folder beside ``out``
    for the command to write everything into. On success what it wrote replaces the earlier
    outputs in ``out`` (``outputs``: the names the command writes, see ``existing_outputs``;
    one it did not write this time goes too); on any failure or signal ``out`` is left as it
    was. The staging folder goes in every case."""
    out = Path(out)
    check_output_dir(out)
    with claim(out):
        found = existing_outputs(out, outputs)
        if found and not force:
            raise FileExistsError(earlier_run(found, flag))
        # the staging folder has the destination's name, inside a hidden folder beside it
        named = out if out.name not in ("", "..") else Path(os.path.abspath(out))
        holder = None
        try:
            for name in temp_names(named):
                holder = Path(name)  # bound before the folder exists: see temp_names
                try:
                    os.mkdir(holder, 0o700)
                    break
                except FileExistsError:
                    holder = None
            stage = holder / named.name
            os.mkdir(stage, without_umask(0o777))
            try:
                yield stage
            except (OSError, ValueError) as e:  # its message names the destination
                if str(holder) not in str(e):
                    raise
                raise type(e)(str(e).replace(str(stage), str(out))) from None
            clash = [out / u for u in _units(stage, outputs) if (out / u).exists()]
            if clash and not force:  # an output no pattern declared
                raise FileExistsError(earlier_run(clash, flag))
            try:
                _commit(stage, out, outputs)
            except OSError as e:
                raise OSError(f"cannot write {out}: {e.strerror or e}") from None
        finally:
            if holder is not None:
                shutil.rmtree(holder, ignore_errors=True)


def earlier_run(found: list[Path], flag: str = "--out") -> str:
    """The one line that refuses an earlier run's outputs ``found`` (``flag``: the option
    that chose the destination)."""
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return (
        f"{found[0]}{more} exists from an earlier run: pass --force to replace the "
        f"earlier run's outputs, or choose another {flag}"
    )
