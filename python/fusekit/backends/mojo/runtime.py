"""Loading, compiling and caching the fusekit Mojo op package for MAX.

Pipeline, cheapest first (each step runs only when the one before it misses):

1. in-process dict: (op, dtypes, device, parameters) -> loaded MAX `Model`;
2. our MEF cache: `<cache>/mef/<unit hash>/<op>-<dtypes>[-<parameters>]-<device>-<spec hash>.mef`, loaded with
   `InferenceSession.compile(path)` + `init` (about 1 ms: no graph build, no Mojo, no compile);
3. compile: `mojo precompile` of the op's compile unit (its file and what it imports, see below) to
   `<cache>/fusekit_<unit>_<unit hash>.mojoc` ("_": the stem is the Mojo module name) (once per version
   of those files, reused by later processes), then one destination-passing MAX graph per (op, dtypes,
   device, parameters) with symbolic dims (one compile covers every shape), exported to step 2's MEF file.
   Parameters are the op's compile-time parameters read from the call's sizes (specs.OpSpec.shape_params,
   GPU graphs only): attention's GPU graphs take `head_dim`, so each compiles its head dim's kernels only
   (bf16 on NVIDIA: forward 7 of 19 kernels, backward 5 of 9; graph compile for a virtual sm_90, 2-core CPU,
   fresh caches, back to back, CPU s: forward 36.2 -> 27.2, backward 34.6 -> 27.1) and two head dims never
   share a model.
   The op writes the caller's output and workspace buffers in place (`ops.inplace_custom`, no
   copy-out, no allocation inside the op).
   MAX's own on-disk model cache (MODULAR_CACHE_DIR, default ~/.cache/modular) stays enabled, so
   even a lost MEF file is a cache hit inside MAX.

`<cache>` is $FUSEKIT_CACHE_DIR or ~/.cache/fusekit. A unit's hash covers every .mojo file it compiles
(name and bytes) plus the max and mojo versions, so editing a kernel or upgrading MAX never reuses a
stale .mojoc or MEF.

Compile units (issue #14 item 3): a first call precompiles only the files of its op, not the whole
package. Each top-level file that registers ops (`rms_norm.mojo`, `attention.mojo`, ...) is a unit named by
its stem; so is each lazy subpackage (LAZY_SUBPACKAGES: `<package>/tc/`, fusekit.swiglu_ffn_tc, whose
`linalg` import alone more than doubles a precompile). A unit compiles its own files, the top-level files
they import (followed through `from ..x import` / `from .x import`) and the package's __init__.mojo
(unit_files), to `<cache>/fusekit_<unit>_<its hash>.mojoc`, loaded as a KernelLibrary of its own (it
registers the imported files' ops too, unused); its MEFs live under `mef/<its hash>/`. Its hash covers
exactly the files it compiles, so an edit elsewhere in the package keeps its compiled models. Against one
.mojoc of the whole package (2-core CPU, fresh caches, rms_norm bf16 for a virtual sm_90, CPU seconds):
`mojo precompile` 6.4 -> 4.3 s, the MAX graph compile 22.4 -> 21.5 s (it reads every op of its .mojoc).

The cache is shared by every process of the user, so it has to survive crashes, races and bad disks:

- Sealed artifacts. Each .mojoc / MEF is built in a private staging dir and renamed into place, and
  `<artifact>.sum` (its size and sha256) is written just before the rename. An artifact whose size or
  hash does not match its .sum (truncated, half-copied, bit rot), or that MAX fails to load, is
  rebuilt with a RuntimeWarning naming the file: never a permanent failure. (Without this, a
  truncated .mojoc failed in every new process: MAX only reads the package when the first graph
  is built, `MAXG_addKernelPackage: failed to import kernels`.)
- One compile per artifact, across processes. The build runs under an exclusive `flock` on
  `<artifact>.lock`; a process that had to wait re-checks the artifact and loads the other one's
  result. A holder that dies releases its lock with it; a waiter gives up after
  $FUSEKIT_LOCK_TIMEOUT seconds (default 1800) and builds itself (renames keep that safe). Threads of
  one process are serialised by `OpCompiler._lock` before they get here.
- An unusable cache dir (uncreatable, read-only, full) never fails a call and never costs a finished
  compile: reads still use what is there, and new artifacts go to a private temporary dir for the
  rest of the process, with one RuntimeWarning naming the dir, the reason and FUSEKIT_CACHE_DIR.
  Nothing touches the disk before the first compile, so constructing `OpCompiler` never fails for a
  cache problem (the backend would report that as "MAX is not installed").
- Progress. Compiles take tens of seconds (the first call of a fresh process is package
  precompile + graph compile), so each one prints a line on stderr when it starts and when it ends,
  e.g. `fusekit: compiling mojo reduce_sum (float32, cpu) — first use, cached in ~/.cache/fusekit`.
  Cache hits print nothing; FUSEKIT_QUIET=1 silences the lines (warnings stay).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import importlib.metadata
import importlib.resources
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from fusekit.backends.mojo.specs import OpSpec, Parameters

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no cross-process lock (renames still keep the cache sane)
    fcntl = None  # type: ignore[assignment]

PACKAGE_ENV = "FUSEKIT_MOJO_PACKAGE"  # optional override of the Mojo package directory
CACHE_ENV = "FUSEKIT_CACHE_DIR"
QUIET_ENV = "FUSEKIT_QUIET"  # "1": no progress lines on stderr
LOCK_TIMEOUT_ENV = "FUSEKIT_LOCK_TIMEOUT"  # seconds to wait for another process's compile
LOCK_TIMEOUT = 1800.0  # a GPU compile of the whole package can take minutes on a loaded machine
# Bump when the graph construction or the cache layout below changes: invalidates every cached
# .mojoc and MEF. "3": artifacts are sealed with a .sum file (older ones have none).
_FORMAT = "3"

T = TypeVar("T")


class MojoBuildError(RuntimeError):
    """The Mojo package or a MAX graph built from it failed to compile; the message has the compiler's text."""


class CacheDirError(OSError):
    """The fusekit cache dir cannot be created or written; the message says what to set."""


# --- locating the package and the tools ------------------------------------------------------------
def locate_package(override: str | os.PathLike[str] | None = None) -> Path:
    """The Mojo op package directory shipped with the installed fusekit.

    Order: explicit `override`, $FUSEKIT_MOJO_PACKAGE, the wheel's package data `fusekit/_mojo/`,
    then (a source checkout run with PYTHONPATH=python) `<repo>/mojo` found relative to the fusekit
    sources, never relative to the working directory.
    """
    if override is None:
        override = os.environ.get(PACKAGE_ENV) or None
    if override is not None:
        path = Path(override).expanduser().resolve()
        if not path.is_dir():
            raise FileNotFoundError(f"Mojo package directory {path} does not exist")
        return path
    try:
        res = importlib.resources.files("fusekit") / "_mojo"
        if res.is_dir():
            return Path(str(res)).resolve()
    except (ModuleNotFoundError, TypeError, NotADirectoryError):
        pass
    import fusekit

    src = getattr(fusekit, "__file__", None)
    # python/fusekit/__init__.py -> repo root; a namespace package (no __init__) has no __file__.
    root = Path(src).resolve().parents[2] if src else Path(__file__).resolve().parents[3]
    path = root / "mojo"
    if not path.is_dir():
        raise FileNotFoundError(
            f"the fusekit Mojo package was not found: neither fusekit/_mojo (installed wheel) nor {path}"
        )
    return path


def mojo_command() -> list[str]:
    """How to run the `mojo` CLI: next to this Python, on PATH, or through the `mojo` package."""
    exe = Path(sys.executable).with_name("mojo")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("mojo")
    if found:
        return [found]
    try:
        import mojo._entrypoints  # noqa: F401 - only checks that the launcher exists
    except ImportError as exc:
        raise MojoBuildError("the `mojo` CLI was not found (pip install mojo==1.2.0)") from exc
    return [sys.executable, "-c", "from mojo._entrypoints import exec_mojo; exec_mojo()"]


def versions() -> str:
    """max and mojo versions, part of every cache key."""
    out = []
    for dist in ("max", "mojo"):
        try:
            out.append(f"{dist}={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{dist}=?")
    return ",".join(out)


def package_files(pkg: Path) -> list[Path]:
    """The op package proper: the top-level .mojo files (ops, `_` helpers, __init__.mojo).

    Subdirectories (e.g. `harness/`, standalone AOT test drivers with their own `main`) are not
    part of the MAX op package, so they are neither hashed nor precompiled.
    """
    return sorted(f for f in pkg.glob("*.mojo") if f.is_file())


# Subpackages whose ops are built only when a call first needs them (see the module docstring); every
# top-level op file is a unit of its own as well (`unit_files`).
LAZY_SUBPACKAGES = ("tc",)
_REGISTER = re.compile(r'@register\("([\w.]+)"\)')
_RELATIVE_IMPORT = re.compile(r"^\s*from\s+(\.+)(\w+)", re.MULTILINE)


def unit_files(pkg: Path, unit: str) -> list[Path]:
    """What the compile unit `unit` compiles: its own .mojo files (the lazy subpackage `<pkg>/<unit>/`'s, or
    the top-level op file `<pkg>/<unit>.mojo`), then the top-level files they import, transitively, and the
    package's __init__.mojo."""
    sub = (pkg / unit).is_dir()
    own = sorted(f for f in (pkg / unit).glob("*.mojo") if f.is_file()) if sub else [pkg / f"{unit}.mojo"]
    top: set[Path] = set() if sub else set(own)
    todo = [(f, 2 if sub else 1) for f in own]  # (file, the number of dots that reach the top level from it)
    while todo:
        f, up = todo.pop()
        for dots, name in _RELATIVE_IMPORT.findall(f.read_text()):
            dep = pkg / f"{name}.mojo"
            if len(dots) == up and dep.is_file() and dep not in top:
                top.add(dep)
                todo.append((dep, 1))
    init = pkg / "__init__.mojo"
    if init.is_file():
        top.add(init)
    return sorted(top) + (own if sub else [])


def package_hash(pkg: Path, sub: str | None = None) -> str:
    """Content hash of the package's .mojo files (name + bytes) and the toolchain versions; with `sub`,
    of the files the compile unit compiles (unit_files)."""
    tag = f"fusekit-mojo/{_FORMAT}/{versions()}" + (f"/{sub}" if sub else "")
    h = hashlib.sha256(tag.encode())
    for f in package_files(pkg) if sub is None else unit_files(pkg, sub):
        h.update(f.relative_to(pkg).as_posix().encode() + b"\0")
        h.update(f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def registered_ops(pkg: Path) -> dict[str, str | None]:
    """MAX op name -> the compile unit that registers it (its top-level file's stem, or its lazy
    subpackage), read from sources."""
    found: dict[str, str | None] = {}
    for sub, files in (
        *((f.stem, [f]) for f in package_files(pkg)),
        *((s, sorted((pkg / s).glob("*.mojo"))) for s in LAZY_SUBPACKAGES),
    ):
        for f in files:
            for name in _REGISTER.findall(f.read_text()):
                found.setdefault(name, sub)  # a top-level op stays its file's
    return found


# --- the cache dir ---------------------------------------------------------------------------------
def _configured_cache() -> tuple[Path | None, str | None]:
    """$FUSEKIT_CACHE_DIR or ~/.cache/fusekit, without touching the disk; (None, why) if neither resolves."""
    try:
        return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "fusekit").expanduser(), None
    except RuntimeError as exc:  # no $HOME and no passwd entry
        return None, f"no home directory to put ~/.cache/fusekit in ({exc})"


def _set_cache_hint() -> str:
    now = os.environ.get(CACHE_ENV)
    state = f"now {now!r}" if now else "now unset, so ~/.cache/fusekit"
    return f"set {CACHE_ENV} to a writable directory ({state})"


def cache_dir() -> Path:
    """The shared cache dir, created. Raises CacheDirError (an OSError) naming FUSEKIT_CACHE_DIR."""
    path, why = _configured_cache()
    if path is None:
        raise CacheDirError(f"fusekit has no cache dir: {why}; {_set_cache_hint()}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CacheDirError(
            f"fusekit cannot create its cache dir {path}: {exc.strerror or exc}; {_set_cache_hint()}"
        ) from exc
    return path


def _quiet() -> bool:
    return os.environ.get(QUIET_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _say(msg: str) -> None:
    """One progress line on stderr (FUSEKIT_QUIET=1 silences it)."""
    if _quiet():
        return
    with contextlib.suppress(OSError, ValueError):  # a closed or broken stderr must not fail a compile
        print(f"fusekit: {msg}", file=sys.stderr, flush=True)


def _show(path: Path) -> str:
    """`path` with the home dir as ~ (the default cache reads as ~/.cache/fusekit)."""
    try:
        return "~" + os.sep + str(path.relative_to(Path.home()))
    except (ValueError, RuntimeError):
        return str(path)


def _warn(msg: str) -> None:
    """A RuntimeWarning attributed to the first caller outside fusekit (and contextlib), so the
    default filter shows it once per place in the user's code, pointing there."""
    level = 2
    frame = sys._getframe(1)
    skip = (str(Path(__file__).parents[2]) + os.sep, contextlib.__file__)
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame = frame.f_back
        level += 1
    warnings.warn(msg, RuntimeWarning, stacklevel=level)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300] if text else type(exc).__name__


# --- sealed artifacts: <artifact> + <artifact>.sum ("<size> <sha256>") -----------------------------
def _sum_path(path: Path) -> Path:
    return path.with_name(path.name + ".sum")


def _file_sum(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _damage(path: Path) -> str | None:
    """None when `path` is intact (size and sha256 match its .sum), else what is wrong with it."""
    try:
        want = _sum_path(path).read_text().split()
    except FileNotFoundError:
        return f"it has no {_sum_path(path).name} (an interrupted write?)"
    except (OSError, UnicodeDecodeError) as exc:
        return f"its {_sum_path(path).name} is unreadable ({_first_line(exc)})"
    try:
        size, digest = _file_sum(path)
    except OSError as exc:
        return f"it is unreadable ({_first_line(exc)})"
    if len(want) != 2 or not want[0].isdigit():
        return f"its {_sum_path(path).name} is malformed"
    if int(want[0]) != size:
        return f"it has {size} bytes, {want[0]} were written (truncated?)"
    if want[1] != digest:
        return "its sha256 differs from the one written with it (corrupted)"
    return None


def _create_temp(d: Path, prefix: str, suffix: str) -> tuple[int, str]:
    """A new file in `d` opened for writing, with the permissions of any new file (0o666 less the umask):
    mkstemp's 0600 made a cache built by one user read as damaged by every other (a shared cache dir, an
    image prebuilt with `python -m fusekit.mojo_build`)."""
    for _ in range(100):
        path = os.path.join(d, f"{prefix}{os.urandom(6).hex()}{suffix}")
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name in {d}")


def _seal(out: Path, final: Path) -> None:
    """Moves the finished artifact `out` to `final`, its .sum first: a reader that sees `final`
    always finds the .sum of its content, a crash in between leaves only a harmless orphan .sum."""
    size, digest = _file_sum(out)
    d = final.parent
    tmps: list[str] = []
    try:
        fd, tmp = _create_temp(d, f".{final.name}.", ".sum.tmp")
        tmps.append(tmp)
        with os.fdopen(fd, "w") as f:
            f.write(f"{size} {digest}\n")
        if out.parent.parent != d:  # staged elsewhere (after a fallback): copy next to `final` first
            fd, tmp = _create_temp(d, f".{final.name}.", ".tmp")
            tmps.append(tmp)
            os.close(fd)
            shutil.copyfile(out, tmp)
            out = Path(tmp)
        os.replace(tmps[0], _sum_path(final))
        os.replace(out, final)
    finally:
        for tmp in tmps:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


class _Store:
    """The cache dir as the compiler uses it.

    Reads look in the shared dir, then in the private one; writes go to the shared dir until one
    fails, then (once `fallback`, with one warning) to a private temporary dir removed at exit.
    """

    def __init__(
        self, shared: Path | None, why: str | None = None, fallback: bool = True, stats: Stats | None = None
    ) -> None:
        self.shared = shared
        self.failed: str | None = why if shared is None else None  # why the shared dir takes no writes
        self.private: Path | None = None
        self.fallback = fallback
        self.stats = stats

    def candidates(self, rel: Path) -> list[Path]:
        return [root / rel for root in (self.shared, self.private) if root is not None]

    def where(self) -> str:
        if self.failed is None and self.shared is not None:
            return f"cached in {_show(self.shared)}"
        return f"kept in {self.private} for this process only"

    def fail(self, reason: str) -> None:
        """The shared dir took no write: from now on write to a private dir (or raise, without fallback)."""
        if self.private is not None:
            return
        self.failed = self.failed or reason
        where = f"the cache dir {self.shared}" if self.shared is not None else "the cache dir"
        if not self.fallback:
            raise CacheDirError(f"fusekit: {where} is not writable ({self.failed}); {_set_cache_hint()}")
        self.private = Path(tempfile.mkdtemp(prefix="fusekit-cache-"))
        weakref.finalize(self, shutil.rmtree, str(self.private), True)
        _warn(
            f"fusekit: {where} is not usable ({self.failed}), so compiled Mojo ops are kept in "
            f"{self.private} for this process only and the next process compiles them again; "
            f"{_set_cache_hint()}",
        )

    def _root(self) -> Path:
        if self.failed is None and self.shared is not None:
            return self.shared
        self.fail(self.failed or "no cache dir")
        assert self.private is not None
        return self.private

    def _dir(self, rel_dir: Path) -> Path:
        """`rel_dir` under the dir that takes writes, created (falling back once)."""
        while True:
            path = self._root() / rel_dir
            try:
                path.mkdir(parents=True, exist_ok=True)
                return path
            except OSError as exc:
                if self.failed is not None:  # the private dir failed too
                    raise
                self.fail(f"cannot create {path}: {exc.strerror or exc}")

    def discard(self, path: Path) -> None:
        for p in (path, _sum_path(path)):
            with contextlib.suppress(OSError):
                p.unlink()

    @contextlib.contextmanager
    def lock(self, rel: Path, what: str) -> Iterator[None]:
        """Holds the cross-process lock of the shared artifact `rel` (if the shared dir takes writes)."""
        if fcntl is None or self.shared is None or self.failed is not None:
            yield
            return
        path = self.shared / rel
        lock_path = path.with_name(path.name + ".lock")
        fd = None
        failure = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            failure = f"cannot create {path.parent}: {exc.strerror or exc}"
        if failure is None:
            try:
                fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as exc:
                failure = f"cannot create {lock_path}: {exc.strerror or exc}"
                with contextlib.suppress(OSError):  # another user's lock file: flock works read-only too
                    fd = os.open(lock_path, os.O_RDONLY)
        if fd is None:
            self.fail(failure or "no lock file")
            yield  # not inside an except: an error of the build must not read as caused by this one
            return
        try:
            self._acquire(fd, lock_path, what)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _acquire(self, fd: int, lock_path: Path, what: str) -> bool:
        try:
            timeout = float(os.environ.get(LOCK_TIMEOUT_ENV) or LOCK_TIMEOUT)
        except ValueError:
            timeout = LOCK_TIMEOUT
        t0 = time.monotonic()
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                pass
            except OSError:  # e.g. ENOLCK on a network filesystem: renames still keep it consistent
                return False
            if not told:
                told = True
                if self.stats is not None:
                    self.stats.lock_waits += 1
                _say(f"waiting for another process {what} (lock {_show(lock_path)})")
            if time.monotonic() - t0 > timeout:
                _warn(
                    f"fusekit: gave up after {timeout:.0f} s waiting for {lock_path} (another process "
                    f"{what}); building here too (raise {LOCK_TIMEOUT_ENV} to wait longer)",
                )
                return False
            time.sleep(0.2)

    def save(self, rel: Path, write: Callable[[Path], None]) -> Path:
        """Runs `write(out)` into a fresh staging dir, then seals `out` as `rel` in the writable dir. A
        staging write that fails for lack of room or rights (the shared dir full, over quota, read-only)
        falls back to the private dir like any other write; a build error of the write itself is raised."""
        while True:
            parent = self._dir(rel.parent)
            try:
                stage = Path(tempfile.mkdtemp(prefix=".stage-", dir=parent))
            except OSError as exc:
                if self.failed is not None:
                    raise
                self.fail(f"cannot write in {parent}: {exc.strerror or exc}")
                continue
            _sweep_stages(parent, keep=stage)
            try:
                out = stage / rel.name
                try:
                    write(out)
                except (OSError, MojoBuildError) as exc:
                    why = _write_failure(exc)
                    if why is None or self.failed is not None:
                        raise
                    self.fail(f"cannot write in {parent}: {why}")
                    continue
                if not out.is_file():
                    raise OSError(f"{out} was not written")
                return self._seal_into(rel, out)
            finally:
                shutil.rmtree(stage, ignore_errors=True)

    def _seal_into(self, rel: Path, out: Path) -> Path:
        while True:
            final = self._dir(rel.parent) / rel.name
            try:
                _seal(out, final)
                return final
            except OSError as exc:
                if self.failed is not None:
                    raise
                self.fail(f"cannot write {final}: {exc.strerror or exc}")


# errno names of a write the filesystem refused (not a fault of what was written)
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
# their messages, as a compiler subprocess prints them (LLVM: `IO failure on output stream: <strerror>`)
_WRITE_TEXTS = tuple(os.strerror(e) for e in sorted(_WRITE_ERRNOS))
STAGE_MAX_AGE_S = 24 * 3600.0  # a staging dir this old belongs to a killed process (a compile takes minutes)


def _write_failure(exc: BaseException) -> str | None:
    """Why `exc` is the cache dir refusing a write (full, over quota, read-only), or None if it is not:
    an OSError with such an errno, or `mojo precompile` failing to write its output (LLVM's `IO failure on
    output stream: No space left on device`)."""
    if isinstance(exc, OSError) and exc.errno in _WRITE_ERRNOS:
        return exc.strerror or str(exc)
    if isinstance(exc, MojoBuildError):
        return next((t for t in _WRITE_TEXTS if t in str(exc)), None)
    return None


def _sweep_stages(parent: Path, keep: Path) -> None:
    """Removes staging dirs in `parent` left by processes killed mid-build (best effort: nothing else ever
    removes them, and a killed process's `mojo precompile` child can still fill one afterwards)."""
    now = time.time()
    with contextlib.suppress(OSError):
        for d in parent.glob(".stage-*"):
            with contextlib.suppress(OSError):
                if d != keep and d.is_dir() and now - d.stat().st_mtime > STAGE_MAX_AGE_S:
                    shutil.rmtree(d, ignore_errors=True)


def _obtain(
    store: _Store, rel: Path, what: str, load: Callable[[Path], T], build: Callable[[bool], T]
) -> tuple[T, bool]:
    """(value, built): `load` of an intact copy of artifact `rel`, else `build(damaged)` under its lock.

    A damaged copy is reported (with a RuntimeWarning) only after the lock is held and it is still
    damaged: a copy another process is replacing at that moment is not damaged.
    """

    def attempt() -> tuple[T | None, list[tuple[Path, str]]]:
        bad = []
        for path in store.candidates(rel):
            try:
                if not path.is_file():
                    continue
            except OSError:
                continue
            reason = _damage(path)
            if reason is None:
                try:
                    return load(path), bad
                except Exception as exc:  # any load failure means "rebuild it"
                    reason = f"loading it failed: {_first_line(exc)}"
            bad.append((path, reason))
        return None, bad

    value, _ = attempt()
    if value is not None:
        return value, False
    with store.lock(rel, what):
        value, bad = attempt()
        if value is not None:
            return value, False
        for path, reason in bad:
            _warn(
                f"fusekit: the cached file {path} is damaged ({reason}); rebuilding it",
            )
            if store.stats is not None:
                store.stats.rebuilds += 1
            store.discard(path)
        return build(bool(bad)), True


# --- building the package --------------------------------------------------------------------------
def _precompile_into(pkg: Path, out: Path, sub: str | None = None) -> None:
    """`mojo precompile` of the package's files (with `sub`: the compile unit's, unit_files) to
    `out` (its stem becomes the Mojo module name)."""
    staged = out.parent / "fusekit_ops"  # only the files package_hash() hashed
    staged.mkdir()
    for f in package_files(pkg) if sub is None else unit_files(pkg, sub):
        dest = staged / f.relative_to(pkg)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dest)
    for d in (staged, *(p for p in staged.rglob("*") if p.is_dir())):
        if not (d / "__init__.mojo").exists():
            (d / "__init__.mojo").write_text("")
    proc = subprocess.run(
        [*mojo_command(), "precompile", str(staged), "-o", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0 or not out.exists():
        text = "\n".join(s for s in (proc.stdout, proc.stderr) if s.strip()).strip()
        text = text.replace(str(staged), str(pkg))  # point diagnostics at the real files
        lines = text.splitlines()
        if len(lines) > 200:  # overload notes can run to thousands of lines; the first errors matter
            text = "\n".join([*lines[:200], f"... ({len(lines) - 200} more lines)"])
        raise MojoBuildError(f"`mojo precompile {pkg}` failed (exit {proc.returncode}):\n{text}")


def _package_rel(digest: str, sub: str | None = None) -> Path:
    """The .mojoc's name in the cache dir (its stem is the Mojo module name)."""
    return Path(f"fusekit_{sub}_{digest}.mojoc" if sub else f"fusekit_{digest}.mojoc")


def _what(pkg: Path, sub: str | None) -> str:
    if sub is None:
        return f"the mojo op package {_show(pkg)}"
    if (pkg / sub).is_dir():
        return f"the mojo op subpackage {_show(pkg / sub)}"
    return f"the mojo op package's unit {sub} ({_show(pkg / sub)}.mojo and what it imports)"


def _build_package(store: _Store, pkg: Path, rel: Path, damaged: bool, sub: str | None = None) -> Path:
    why = "rebuilding a damaged cache file" if damaged else "first use of this version"
    _say(f"precompiling {_what(pkg, sub)} — {why}, {store.where()}")
    t0 = time.perf_counter()
    path = store.save(rel, lambda out: _precompile_into(pkg, out, sub))
    what = "the mojo op package" if sub is None else f"the mojo op package's unit {sub}"
    _say(f"precompiled {what} in {time.perf_counter() - t0:.1f} s")
    return path


def precompile(pkg: Path, digest: str, cache: Path, sub: str | None = None) -> Path:
    """`mojo precompile` the package (or its compile unit `sub`, `digest` then being its hash) once
    per content hash into `cache`; later processes reuse the .mojoc (a damaged one is rebuilt). Raises
    CacheDirError when `cache` takes no writes."""
    store = _Store(Path(cache), fallback=False)
    rel = _package_rel(digest, sub)
    path, _ = _obtain(
        store,
        rel,
        f"to finish precompiling {_what(pkg, sub)}",
        lambda p: p,
        lambda damaged: _build_package(store, pkg, rel, damaged, sub),
    )
    return path


def _load_library(path: Path) -> Any:
    """A KernelLibrary over the .mojoc, read now: MAX reads it lazily, at the first graph built,
    where a bad file would look like a kernel error (`MAXG_addKernelPackage: failed to import kernels`)."""
    from max.graph import KernelLibrary

    error = None
    with _capture_stderr() as noise:
        try:
            lib = KernelLibrary([path])
            _ = "fusekit.__probe__" in lib  # forces the import of the package
        except Exception as exc:  # re-raised below with MAX's text
            error = exc
    text = "".join(noise).strip()
    if error is not None:
        raise RuntimeError(f"{text} ({_first_line(error)})" if text else _first_line(error)) from error
    if text:
        sys.stderr.write(text + "\n")
    return lib


@contextlib.contextmanager
def _capture_stderr() -> Iterator[list[str]]:
    """Collects what native code writes to fd 2 (MAX prints Mojo diagnostics there, not into the
    exception) into the yielded list, available when the block ends."""
    text: list[str] = []
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield text
        return
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield text
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text.append(tmp.read().decode(errors="replace"))


@contextlib.contextmanager
def _tee_stderr() -> Iterator[list[str]]:
    """`_capture_stderr`, still echoing the text to the real stderr. Only used around rare, slow
    graph compiles."""
    text: list[str] = []
    try:
        with _capture_stderr() as text:
            yield text
    finally:
        if text and text[0]:
            sys.stderr.write(text[0])


def _chain(exc: BaseException) -> str:
    """The messages of an exception and its causes, innermost (the compiler's text) first."""
    msgs = []
    seen: BaseException | None = exc
    while seen is not None and len(msgs) < 8:
        msgs.append(str(seen).strip())
        seen = seen.__cause__ or seen.__context__
    return "\n".join(reversed(msgs))


# --- devices ---------------------------------------------------------------------------------------
_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
}


def max_dtype(dtype: torch.dtype) -> Any:
    from max.dtype import DType

    return getattr(DType, _DTYPES[dtype])


def max_device(device: torch.device) -> Any:
    from max.driver import CPU, Accelerator

    return CPU() if device.type == "cpu" else Accelerator(device.index or 0)


@contextlib.contextmanager
def graph_device(device: torch.device) -> Iterator[None]:
    """While a MAX Graph is built for `device`: MAX 26.7's Graph records "the" accelerator's
    architecture for the compile target with `Accelerator()`, i.e. GPU 0 (Graph.
    _populate_device_info_mapping). For a graph of another GPU that opens GPU 0's context in a process
    that never used it, and would target GPU 0's architecture on a mixed machine: there, the name
    `Accelerator` in max.graph.graph gives this graph's GPU instead. Builds are serialized by
    OpCompiler's lock; a MAX without that name is left alone."""
    import max.graph.graph as mg

    real = getattr(mg, "Accelerator", None)
    index = device.index or 0
    if device.type != "cuda" or index == 0 or real is None:
        yield
        return

    def accelerator(*args: Any, **kwargs: Any) -> Any:
        return real(*args, **kwargs) if args or kwargs else real(index)

    mg.Accelerator = accelerator
    try:
        yield
    finally:
        mg.Accelerator = real


@functools.cache
def _cpu_tag() -> str:
    """`cpu-<machine>-<hash of the CPU's feature flags>`: a CPU MEF holds machine code for this host's ISA
    extensions (AVX-512 on the machine that built it), so a cache dir shared between hosts (NFS home, a
    prebuilt image) must not hand it to a CPU without them, nor to another architecture."""
    flags = ""
    with contextlib.suppress(OSError, UnicodeDecodeError), open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip().lower() in ("flags", "features"):  # x86 / arm64
                flags = value
                break
    flags = " ".join(sorted(flags.split())) or platform.processor()
    return f"cpu-{platform.machine() or 'unknown'}-{hashlib.sha256(flags.encode()).hexdigest()[:8]}"


def device_tag(device: torch.device) -> str:
    """Names the compile target in cache file names: e.g. `cpu-x86_64-1a2b3c4d` or `cuda-sm_90-0`."""
    if device.type == "cpu":
        return _cpu_tag()
    dev = max_device(device)
    return f"{dev.api}-{dev.architecture_name}-{device.index or 0}"


# --- the compiler/cache ----------------------------------------------------------------------------
@dataclass
class Compiled:
    """One loaded graph: `model(out..., in..., params)` for every shape of one (op, dtypes, device) at its
    compile-time parameters (`parameters`: e.g. attention's head dim on a GPU)."""

    spec: OpSpec
    dtypes: tuple[torch.dtype, ...]
    device: torch.device
    model: Any
    parameters: Parameters = ()
    # Replay state, owned by the dispatcher: argument key -> captured graph key, keys seen once.
    graphs: dict = field(default_factory=dict)
    seen: dict = field(default_factory=dict)
    next_graph: int = 1
    captures: int = 0  # graphs captured (dispatch.may_capture weighs them against the replays)
    replays: int = 0
    capturable: bool = True  # False once a capture failed: the model then always executes
    capture_error: str | None = None  # why (the first line of the capture's exception)
    # (dtype, size function) of each of the spec's workspaces, resolved for `dtypes` once
    workspaces: tuple = field(init=False)

    def __post_init__(self) -> None:
        self.workspaces = tuple(
            (self.spec.tensor_dtype(w, self.dtypes), w.size) for w in self.spec.workspaces
        )


@dataclass
class Stats:
    """Counters for tests and reports: how often each cache level was hit or missed."""

    precompiles: int = 0  # `mojo precompile` runs of this process (one per compile unit used)
    graph_compiles: int = 0  # MAX graph compiles of this process
    mef_loads: int = 0  # MEF files loaded from the disk cache
    rebuilds: int = 0  # damaged cache files found and rebuilt
    lock_waits: int = 0  # times another process held the lock of an artifact we needed
    seconds: dict = field(default_factory=dict)


def _dtype_label(spec: OpSpec, dtypes: tuple[torch.dtype, ...], parameters: Parameters = ()) -> str:
    """`bfloat16` when every dtype variable has one dtype, else `x=bfloat16, out=float32`; then the
    compile-time parameters (`, head_dim=128`)."""
    names = [_DTYPES.get(d, str(d)) for d in dtypes]
    if len(set(names)) <= 1:
        label = names[0] if names else ""
    else:
        label = ", ".join(f"{v}={n}" for v, n in zip(spec.dtype_vars, names))
    return ", ".join([label, *(f"{k}={v}" for k, v in parameters)])


class OpCompiler:
    """Gives the loaded MAX model for (op spec, dtypes, device), compiling at most once ever.

    Construction touches no cache file (a cache problem must not read as "MAX is missing"); the
    cache dir is first used by the first `get`.
    """

    def __init__(self, package: str | os.PathLike[str] | None = None) -> None:
        self.package = locate_package(package)
        self.digest = package_hash(self.package)
        self.ops = registered_ops(self.package)  # MAX op -> its compile unit (None: the whole package)
        self._digests: dict[str | None, str] = {None: self.digest}  # a unit's: on its first use
        self.stats = Stats()
        cache, why = _configured_cache()
        self.cache = cache  # the shared cache dir, as configured (None: no home dir)
        self.store = _Store(cache, why, stats=self.stats)
        self._models: dict[tuple, Compiled] = {}
        self._sessions: dict[str, Any] = {}
        self._libraries: dict[str | None, Any] = {}
        self._lock = threading.Lock()

    def has_op(self, op: str) -> bool:
        return (self.package / f"{op}.mojo").exists()

    def get(
        self,
        spec: OpSpec,
        dtypes: tuple[torch.dtype, ...],
        device: torch.device,
        parameters: Parameters = (),
    ) -> Compiled:
        """The model of (spec, dtypes, device) at the compile-time `parameters` (spec.parameters of a call)."""
        # the MAX op too: swiglu_ffn's forward has two (specs.SWIGLU_FFN_TC_OP)
        key = (spec.op, spec.max_op, dtypes, device, parameters)
        hit = self._models.get(key)
        if hit is not None:
            return hit
        with self._lock:
            hit = self._models.get(key)
            if hit is None:
                model = self._load(spec, dtypes, device, parameters)
                hit = self._models[key] = Compiled(spec, dtypes, device, model, parameters)
        return hit

    # ------------------------------------------------------------------------------------------------
    def _session(self, device: torch.device) -> Any:
        from max.engine import InferenceSession

        tag = str(device)
        if tag not in self._sessions:
            self._sessions[tag] = InferenceSession(devices=[max_device(device)])
        return self._sessions[tag]

    def subpackage(self, max_op: str) -> str | None:
        """The compile unit that registers `max_op` (its file's stem or lazy subpackage; None: the whole
        package, for an op no file registers)."""
        return self.ops.get(max_op)

    def digest_of(self, sub: str | None) -> str:
        """The content hash of the package (None) or of the compile unit `sub`."""
        if sub not in self._digests:
            self._digests[sub] = package_hash(self.package, sub)
        return self._digests[sub]

    def mef_rel(
        self,
        spec: OpSpec,
        dtypes: tuple[torch.dtype, ...],
        device: torch.device,
        parameters: Parameters = (),
    ) -> Path:
        """The MEF's path relative to the cache dir (under the hash of the package its op is built from); the
        compile-time parameters are part of the name (`attention-bfloat16-head_dim128-cuda-sm_90-0-...`)."""
        sig = repr((spec.max_op, spec.outputs, spec.workspaces, spec.inputs, spec.params))
        sig = hashlib.sha256(sig.encode()).hexdigest()
        names = "_".join(_DTYPES[d] for d in dtypes) + "".join(f"-{k}{v}" for k, v in parameters)
        digest = self.digest_of(self.subpackage(spec.max_op))
        return Path("mef") / digest / f"{spec.op}-{names}-{device_tag(device)}-{sig[:8]}.mef"

    def mef_path(
        self,
        spec: OpSpec,
        dtypes: tuple[torch.dtype, ...],
        device: torch.device,
        parameters: Parameters = (),
    ) -> Path:
        """Where the MEF lives in the shared cache dir (see `store` for the private fallback)."""
        root = self.cache if self.cache is not None else Path(tempfile.gettempdir())
        return root / self.mef_rel(spec, dtypes, device, parameters)

    def _load(
        self, spec: OpSpec, dtypes: tuple[torch.dtype, ...], device: torch.device, parameters: Parameters = ()
    ) -> Any:
        session = self._session(device)
        rel = self.mef_rel(spec, dtypes, device, parameters)
        where = "cpu" if device.type == "cpu" else device_tag(device)
        label = f"mojo {spec.op} ({_dtype_label(spec, dtypes, parameters)}, {where})"
        t0 = time.perf_counter()

        def load(path: Path) -> Any:
            return session.init(session.compile(path))

        def build(damaged: bool) -> Any:
            self.library(self.subpackage(spec.max_op))  # first: its progress lines come before this op's
            why = "rebuilding a damaged cache file" if damaged else "first use"
            _say(f"compiling {label} — {why}, {self.store.where()}")
            t1 = time.perf_counter()
            graph = self._graph(spec, dtypes, device, parameters)
            error = None
            with _tee_stderr() as diagnostics:
                try:
                    compiled = session.compile(graph)
                except Exception as exc:  # re-raised below with the compiler text
                    error = exc
            if error is not None:
                at = f" at {dict(parameters)}" if parameters else ""
                raise MojoBuildError(
                    f"compiling {spec.max_op} for {[_DTYPES[d] for d in dtypes]}{at} on {device} failed "
                    f"(package {self.package}):\n{''.join(diagnostics).strip()}\n{_chain(error)}"
                ) from error
            try:
                self.store.save(rel, lambda out: compiled.export_mef(str(out)))
            except Exception as exc:  # the compiled model is still good: keep it
                _warn(
                    f"fusekit: could not save the compiled {label} ({_first_line(exc)}); it is kept in "
                    f"memory for this process only; {_set_cache_hint()}",
                )
            model = session.init(compiled)
            self.stats.graph_compiles += 1
            _say(f"compiled {label} in {time.perf_counter() - t1:.1f} s")
            return model

        model, built = _obtain(self.store, rel, f"to finish compiling {label}", load, build)
        if not built:
            self.stats.mef_loads += 1
        self.stats.seconds[f"{'compile' if built else 'load'} {rel.name}"] = time.perf_counter() - t0
        return model

    def library(self, sub: str | None = None) -> Any:
        """The MAX KernelLibrary over the precompiled package, or over its compile unit `sub` (each
        built once per version of its files)."""
        if sub not in self._libraries:
            t0 = time.perf_counter()
            rel = _package_rel(self.digest_of(sub), sub)

            def build(damaged: bool) -> Any:
                path = _build_package(self.store, self.package, rel, damaged, sub)
                self.stats.precompiles += 1
                return _load_library(path)

            what = f"to finish precompiling {_what(self.package, sub)}"
            self._libraries[sub], _ = _obtain(self.store, rel, what, _load_library, build)
            self.stats.seconds["precompile+library" + (f" {sub}" if sub else "")] = time.perf_counter() - t0
        return self._libraries[sub]

    def _graph(
        self, spec: OpSpec, dtypes: tuple[torch.dtype, ...], device: torch.device, parameters: Parameters = ()
    ) -> Any:
        """A destination-passing graph: outputs (then workspaces) are buffer inputs the custom op writes
        in place; `parameters` are the custom op's compile-time parameters (none: the Mojo defaults).

        `ops.inplace_custom` hands the caller's buffers to the kernel's MutableInputTensor outputs and
        workspaces.
        (`ops.custom` + `buf[...] = result` made the kernel write a MAX temporary that a
        `mo.mutable.store` then copied into the buffer: one more read + write of every output, which
        halved the bandwidth of every memory-bound op.)
        """
        from max.graph import DeviceRef, Graph, TensorType, ops

        ref = DeviceRef.CPU() if device.type == "cpu" else DeviceRef.GPU(device.index or 0)

        def ttype(ts: Any) -> Any:
            return TensorType(max_dtype(spec.tensor_dtype(ts, dtypes)), list(ts.dims), device=ref)

        out_types = [ttype(s) for s in spec.outputs + spec.workspaces]
        in_types = [ttype(s) for s in spec.inputs]
        if spec.params:
            in_types.append(TensorType(max_dtype(torch.float32), [len(spec.params)], device=ref))
        names = "_".join(_DTYPES[d] for d in dtypes) + "".join(f"_{k}{v}" for k, v in parameters)
        with (
            graph_device(device),
            Graph(
                f"fusekit_{spec.op}_{names}",
                input_types=[t.as_buffer() for t in out_types] + in_types,
                kernel_library=self.library(self.subpackage(spec.max_op)),
            ) as g,
        ):
            n = len(out_types)
            values = [v.buffer for v in g.inputs[:n]] + [v.tensor for v in g.inputs[n:]]
            ops.inplace_custom(spec.max_op, ref, values=values, parameters=dict(parameters) or None)
            g.output()
        return g
