"""Loading, compiling and caching the fusekit Mojo op package for MAX.

Pipeline, cheapest first (each step runs only when the one before it misses):

1. in-process dict: (op, dtypes, device) -> loaded MAX `Model`;
2. our MEF cache: `<cache>/mef/<package hash>/<op>-<dtypes>-<device>-<spec hash>.mef`, loaded with
   `InferenceSession.compile(path)` + `init` (about 1 ms: no graph build, no Mojo, no compile);
3. compile: `mojo precompile` of the package's top-level .mojo files to
   `<cache>/fusekit_<package hash>.mojoc` ("_": the stem is the Mojo module name) (once per package
   version, reused by later processes), then one destination-passing MAX graph per (op, dtypes,
   device) with symbolic dims (one compile covers every shape), exported to step 2's MEF file.
   The op writes the caller's output buffers in place (`ops.inplace_custom`, no copy-out).
   MAX's own on-disk model cache (MODULAR_CACHE_DIR, default ~/.cache/modular) stays enabled, so
   even a lost MEF file is a cache hit inside MAX.

`<cache>` is $FUSEKIT_CACHE_DIR or ~/.cache/fusekit. The package hash covers every top-level .mojo
file of the package (name and bytes) plus the max and mojo versions, so editing a kernel or upgrading MAX
never reuses a stale .mojoc or MEF. Files are written to a temporary name and renamed, so
concurrent processes never read a half-written artifact.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.resources
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fusekit.backends.mojo_specs import OpSpec

PACKAGE_ENV = "FUSEKIT_MOJO_PACKAGE"  # optional override of the Mojo package directory
CACHE_ENV = "FUSEKIT_CACHE_DIR"
_FORMAT = "2"  # bump when the graph construction below changes: invalidates every cached MEF


class MojoBuildError(RuntimeError):
    """The Mojo package or a MAX graph built from it failed to compile; the message has the compiler's text."""


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


def package_hash(pkg: Path) -> str:
    """Content hash of the package's .mojo files (name + bytes) and the toolchain versions."""
    h = hashlib.sha256(f"fusekit-mojo/{_FORMAT}/{versions()}".encode())
    for f in package_files(pkg):
        h.update(f.name.encode() + b"\0")
        h.update(f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    path = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "fusekit").expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _atomic_target(final: Path) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + final.stem + ".", suffix=".tmp" + final.suffix, dir=final.parent)
    os.close(fd)
    return Path(tmp)


def precompile(pkg: Path, digest: str, cache: Path) -> Path:
    """`mojo precompile` the package once per content hash; later processes reuse the .mojoc."""
    # The file stem becomes the Mojo module name MAX imports, so it must be an identifier (no "-")
    # and is fixed at precompile time: build under the final name in a private dir, then rename.
    final = cache / f"fusekit_{digest}.mojoc"
    if final.exists():
        return final
    tmpdir = Path(tempfile.mkdtemp(prefix=".precompile-", dir=cache))
    try:
        staged = tmpdir / "fusekit_ops"  # only the files package_files() hashed
        staged.mkdir()
        for f in package_files(pkg):
            shutil.copy2(f, staged / f.name)
        if not (staged / "__init__.mojo").exists():
            (staged / "__init__.mojo").write_text("")
        out = tmpdir / final.name
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
        os.replace(out, final)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return final


@contextlib.contextmanager
def _tee_stderr() -> Iterator[list[str]]:
    """Collects what native code writes to fd 2 (MAX prints Mojo diagnostics there, not into the
    exception), still echoing it to the real stderr. Only used around rare, slow graph compiles."""
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
            data = tmp.read().decode(errors="replace")
            if data:
                sys.stderr.write(data)
            text.append(data)


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


def device_tag(device: torch.device) -> str:
    """Names the compile target in cache file names: `cpu` or e.g. `cuda-sm_90-0`."""
    if device.type == "cpu":
        return "cpu"
    dev = max_device(device)
    return f"{dev.api}-{dev.architecture_name}-{device.index or 0}"


# --- the compiler/cache ----------------------------------------------------------------------------
@dataclass
class Compiled:
    """One loaded graph: `model(out..., in..., params)` for every shape of one (op, dtypes, device)."""

    spec: OpSpec
    dtypes: tuple[torch.dtype, ...]
    device: torch.device
    model: Any
    # Replay state, owned by the dispatcher: argument key -> captured graph key, keys seen once.
    graphs: dict = field(default_factory=dict)
    seen: dict = field(default_factory=dict)
    next_graph: int = 1
    capturable: bool = True


@dataclass
class Stats:
    """Counters for tests and reports: how often each cache level was hit or missed."""

    precompiles: int = 0
    graph_compiles: int = 0
    mef_loads: int = 0
    seconds: dict = field(default_factory=dict)


class OpCompiler:
    """Gives the loaded MAX model for (op spec, dtypes, device), compiling at most once ever."""

    def __init__(self, package: str | os.PathLike[str] | None = None) -> None:
        self.package = locate_package(package)
        self.digest = package_hash(self.package)
        self.cache = cache_dir()
        self.stats = Stats()
        self._models: dict[tuple, Compiled] = {}
        self._sessions: dict[str, Any] = {}
        self._library: Any = None
        self._lock = threading.Lock()

    def has_op(self, op: str) -> bool:
        return (self.package / f"{op}.mojo").exists()

    def get(self, spec: OpSpec, dtypes: tuple[torch.dtype, ...], device: torch.device) -> Compiled:
        key = (spec.op, dtypes, device)
        hit = self._models.get(key)
        if hit is not None:
            return hit
        with self._lock:
            hit = self._models.get(key)
            if hit is None:
                hit = self._models[key] = Compiled(spec, dtypes, device, self._load(spec, dtypes, device))
        return hit

    # ------------------------------------------------------------------------------------------------
    def _session(self, device: torch.device) -> Any:
        from max.engine import InferenceSession

        tag = str(device)
        if tag not in self._sessions:
            self._sessions[tag] = InferenceSession(devices=[max_device(device)])
        return self._sessions[tag]

    def mef_path(self, spec: OpSpec, dtypes: tuple[torch.dtype, ...], device: torch.device) -> Path:
        sig = hashlib.sha256(repr((spec.max_op, spec.outputs, spec.inputs, spec.params)).encode()).hexdigest()
        names = "_".join(_DTYPES[d] for d in dtypes)
        return self.cache / "mef" / self.digest / f"{spec.op}-{names}-{device_tag(device)}-{sig[:8]}.mef"

    def _load(self, spec: OpSpec, dtypes: tuple[torch.dtype, ...], device: torch.device) -> Any:
        session = self._session(device)
        path = self.mef_path(spec, dtypes, device)
        t0 = time.perf_counter()
        if path.exists():
            try:
                model = session.init(session.compile(path))
                self.stats.mef_loads += 1
                self.stats.seconds[f"load {path.name}"] = time.perf_counter() - t0
                return model
            except Exception:  # a corrupt or foreign MEF is rebuilt below
                path.unlink(missing_ok=True)
        graph = self._graph(spec, dtypes, device)
        error = None
        with _tee_stderr() as diagnostics:
            try:
                compiled = session.compile(graph)
            except Exception as exc:  # re-raised below with the compiler text
                error = exc
        if error is not None:
            raise MojoBuildError(
                f"compiling {spec.max_op} for {[_DTYPES[d] for d in dtypes]} on {device} failed "
                f"(package {self.package}):\n{''.join(diagnostics).strip()}\n{_chain(error)}"
            ) from error
        tmp = _atomic_target(path)
        try:
            compiled.export_mef(str(tmp))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        model = session.init(compiled)
        self.stats.graph_compiles += 1
        self.stats.seconds[f"compile {path.name}"] = time.perf_counter() - t0
        return model

    def library(self) -> Any:
        if self._library is None:
            from max.graph import KernelLibrary

            t0 = time.perf_counter()
            fresh = not (self.cache / f"fusekit_{self.digest}.mojoc").exists()
            mojoc = precompile(self.package, self.digest, self.cache)
            self.stats.precompiles += int(fresh)
            self._library = KernelLibrary([mojoc])
            self.stats.seconds["precompile+library"] = time.perf_counter() - t0
        return self._library

    def _graph(self, spec: OpSpec, dtypes: tuple[torch.dtype, ...], device: torch.device) -> Any:
        """A destination-passing graph: outputs are buffer inputs the custom op writes in place.

        `ops.inplace_custom` hands the caller's buffers to the kernel's MutableInputTensor outputs.
        (`ops.custom` + `buf[...] = result` made the kernel write a MAX temporary that a
        `mo.mutable.store` then copied into the buffer: one more read + write of every output, which
        halved the bandwidth of every memory-bound op.)
        """
        from max.graph import DeviceRef, Graph, TensorType, ops

        ref = DeviceRef.CPU() if device.type == "cpu" else DeviceRef.GPU(device.index or 0)

        def ttype(ts: Any) -> Any:
            return TensorType(max_dtype(spec.tensor_dtype(ts, dtypes)), list(ts.dims), device=ref)

        out_types = [ttype(s) for s in spec.outputs]
        in_types = [ttype(s) for s in spec.inputs]
        if spec.params:
            in_types.append(TensorType(max_dtype(torch.float32), [len(spec.params)], device=ref))
        names = "_".join(_DTYPES[d] for d in dtypes)
        with Graph(
            f"fusekit_{spec.op}_{names}",
            input_types=[t.as_buffer() for t in out_types] + in_types,
            kernel_library=self.library(),
        ) as g:
            n = len(out_types)
            values = [v.buffer for v in g.inputs[:n]] + [v.tensor for v in g.inputs[n:]]
            ops.inplace_custom(spec.max_op, ref, values=values)
            g.output()
        return g
