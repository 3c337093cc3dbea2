"""File safety for every output fbt-probe writes: check an output before any work, and write
files and folders atomically (whole or not at all, a Ctrl-C included).

It sits in the lowest layer (``fbt_probe.util``, below ``tasks``) because every other layer
writes files: datasets in ``tasks``, checkpoints and run folders in ``fbt_probe``, results in
``probes``.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import secrets
import shlex
import shutil
import socket
import stat
import sys
import time
from contextlib import contextmanager
from pathlib import Path


def _kind(path: Path) -> str:

    mode = path.lstat().st_mode
    for test, name in (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "a regular file"


def _writable_parent(path: Path) -> None:
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK):
        raise PermissionError(f"cannot write to {path} ({probe} is not a writable folder)")


def check_output_file(out: Path, force: bool = False) -> None:
    """Before any work: ``out`` may be written. An existing regular file needs ``force``;
    anything else (a directory, a FIFO, a device, a symlink) is never replaced, even with
    ``force``: a symlink would be replaced by a file, not written through."""
    out = Path(out)
    if out.is_symlink() or out.exists():
        kind = _kind(out)
        if kind != "a regular file":
            raise FileExistsError(f"{out} is {kind}; refusing to replace it (choose another --out)")
        if not force:
            raise FileExistsError(f"{out} exists; pass --force to overwrite")
    _writable_parent(out.parent if str(out.parent) else Path("."))


def check_output_dir(out: Path) -> None:
    """Before any work: ``out`` is, or can be made, a writable folder."""
    out = Path(out)
    if out.is_symlink() and not out.is_dir():
        raise FileExistsError(f"{out} is a symlink to something that is not a folder")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} is {_kind(out)}, not a folder (choose another --out)")
    _writable_parent(out)


def without_umask(mode: int) -> int:
    """``mode`` as a plain ``open`` or ``mkdir`` would leave it (mkstemp and mkdtemp make
    files only their owner can read)."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def temp_names(out: Path):
    """Names for a temporary file or folder next to ``out``, to be created by the caller
    after the name is bound: a Ctrl-C that lands while the file is being created (mkstemp
    and mkdtemp return its name only after) still leaves the name to the clean-up."""
    for _ in range(100):
        yield str(out.parent / f".{out.name}.{secrets.token_hex(4)}.tmp")
    raise FileExistsError(f"cannot make a temporary name next to {out}")


def _create_file(path: str) -> None:
    """Create ``path`` empty, only if nothing is there (as mkstemp does)."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def atomic_write(out: Path, write) -> None:
    """Call ``write(tmp_path)`` then rename onto ``out``; on any error remove the temp file."""
    tmp = None
    if out.is_symlink() or (out.exists() and not out.is_file()):
        raise FileExistsError(f"{out} is {_kind(out)}; refusing to replace it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        for tmp in temp_names(out):  # named before it exists: see temp_names
            try:
                _create_file(tmp)
                break
            except FileExistsError:
                tmp = None
        write(tmp)
        os.chmod(tmp, without_umask(0o666))
        os.replace(tmp, out)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise OSError(f"cannot write {out}: {e.strerror or e}") from None
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise


def atomic_folder(out: Path, write) -> None:
    """Call ``write(tmp_folder)`` then put that folder at ``out``, replacing a folder there;
    on any error the temporary folder goes and ``out`` keeps what it held."""

    out = Path(out)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise FileExistsError(f"{out} is {_kind(out)}; refusing to replace it")
    tmp = old = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        for name in temp_names(out):
            tmp = Path(name)  # bound before the folder exists
            try:
                os.mkdir(tmp, 0o700)
                break
            except FileExistsError:
                tmp = None
        os.chmod(tmp, without_umask(0o777))
        write(tmp)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
        os.replace(tmp, out)
        tmp = None
    except OSError as e:
        raise OSError(f"cannot write {out}: {e.strerror or e}") from None
    finally:
        # an error or a Ctrl-C between the two replaces: ``out`` gets back what it held
        if old is not None and Path(old).exists() and not out.exists():
            os.replace(old, out)
        for leftover in (tmp, old):
            if leftover is not None and Path(leftover).exists():
                shutil.rmtree(leftover, ignore_errors=True)


def read_json(path: Path, what: str, fields: tuple[str, ...] = ()) -> dict:
    """The JSON object in ``path`` that holds ``fields``, or a one-line ValueError naming
    ``path``, what it should be (``what``) and what is wrong: every file fbt-probe reads back
    (its own earlier outputs, a user's edit of them) goes through here."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} is not a file ({what} expected there)")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a {what} (not UTF-8 text)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not a {what} (bad JSON: {e.msg}, line {e.lineno})") from None
    except OSError as e:
        raise ValueError(f"{path} cannot be read ({e.strerror or e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} is not a {what} (a JSON {type(value).__name__}, not an object)")
    missing = [f for f in fields if f not in value]
    if missing:
        raise ValueError(f"{path} is not a {what} (no {missing[0]!r})")
    return value


def read_tensors(path: Path, what: str, numpy: bool = False) -> dict:
    """The tensors (``numpy``: arrays) of the safetensors file ``path``, or a one-line
    ValueError naming it."""
    if numpy:
        from safetensors.numpy import load_file
    else:
        from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} is not a file ({what} expected there)")
    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{path} is not a {what} ({first})") from None


def read_record(path: Path, fmt: str, what: str) -> dict:
    """A JSON object whose ``format`` is ``fmt`` (a file fbt-probe wrote), or a one-line
    ValueError naming ``path`` and what it should have been (``what``)."""

    try:
        rec = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({getattr(e, 'msg', e)})") from None
    if not isinstance(rec, dict) or rec.get("format") != fmt:
        raise ValueError(f"{path} is not an fbt-probe {what}")
    return rec


# ---- one writer per output ------------------------------------------------------------------
def lock_path(out: Path) -> Path:
    """The claim of ``out`` (a file or a folder): a hidden file beside it."""
    out = Path(out)
    return out.parent / f".{out.name}.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _holder(lock: Path) -> dict | None:
    """Who holds ``lock``, or None when its writer is gone (a crashed or killed run: the
    claim is stale). A claim of another machine (a shared disk) is taken as held."""

    try:
        info = json.loads(lock.read_text())
        pid, host = int(info["pid"]), str(info["host"])
    except (OSError, ValueError, KeyError, TypeError):
        # being written this instant, or damaged: held while young, stale after a minute
        try:
            return {} if time.time() - lock.stat().st_mtime < 60 else None
        except OSError:
            return None
    if host == socket.gethostname() and not _alive(pid):
        return None
    return info


def _take(lock: Path, out: Path, tried: list) -> None:
    """Create ``lock`` exclusively and write this process into it; ``tried[0]`` is true from
    just before the create until another writer's lock is found."""
    me = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "command": shlex.join(sys.argv),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    for _ in range(5):
        tried[0] = True
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, without_umask(0o666))
        except FileExistsError:
            tried[0] = False
            holder = _holder(lock)
            if holder is None:  # stale: its writer is gone
                lock.unlink(missing_ok=True)
                continue
            who = (
                (
                    f"process {holder['pid']} on {holder['host']} ({holder['command']}), since "
                    f"{holder['since']}"
                )
                if holder
                else "another process"
            )
            raise FileExistsError(
                f"{out} is being written by {who}; wait for it to end, or "
                f"delete {lock} if that process is gone"
            ) from None
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(me) + "\n")
        return
    raise FileExistsError(f"cannot claim {out}: {lock} keeps coming back")


def _release(lock: Path, tried: bool) -> None:
    """Remove the claim if it is this process's: the lock names this process, or is still
    empty after this process's exclusive create (a signal came before the write)."""
    if not tried:
        return
    try:
        text = lock.read_text()
    except OSError:
        return
    try:
        mine = not text.strip() or json.loads(text).get("pid") == os.getpid()
    except (ValueError, AttributeError):
        mine = False
    if mine:
        lock.unlink(missing_ok=True)


@contextmanager
def claim(out: Path):
    """Hold ``out`` (a file or a folder) for this process while it is written: a second
    writer fails at once, in one line naming the holder, instead of silently replacing the
    first one's output or mixing its files with them. The claim is a hidden lock file beside
    ``out``, made by exclusive create and removed on the way out (Ctrl-C included); one left
    by a writer that crashed or was killed is found stale (its process is gone) and cleared.
    Folders made to hold the claim are removed again when nothing was written into them."""
    out = Path(out)
    _writable_parent(out.parent)
    made = []
    parent = out.parent
    while not parent.exists():
        made.append(parent)
        parent = parent.parent
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot write to {out} ({e.strerror or e})") from None
    lock = lock_path(out)
    tried = [False]  # set before the exclusive create: a signal right after it still cleans up
    try:
        try:
            _take(lock, out, tried)
            yield out
        finally:
            _release(lock, tried[0])
    finally:
        for d in made:  # innermost first
            try:
                d.rmdir()
            except OSError:
                pass


def claims(param: str):
    """Decorate a function that writes into its argument ``param`` (a file or folder path)
    so that it runs under ``claim`` of that path."""

    def wrap(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def claimed(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            with claim(Path(bound.arguments[param])):
                return fn(*args, **kwargs)

        return claimed

    return wrap
