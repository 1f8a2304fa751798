"""The mojo backend's compile cache under damage, bad cache dirs and concurrency (runtime.py).

What must hold: a truncated .mojoc or MEF is rebuilt with a RuntimeWarning naming it (never a
permanent failure); an unwritable or uncreatable FUSEKIT_CACHE_DIR gives a correct result and a
warning naming FUSEKIT_CACHE_DIR (never an install hint, never a lost compile); processes started
at once on an empty cache share one compile; a compile prints a progress line, a cache hit nothing.

Every step that compiles runs in a subprocess with a timeout (a MAX CPU compile takes tens of
seconds, minutes on a loaded 2-core box). Only one graph is ever compiled: reduce_sum float32 on the
CPU, from a copy of the repo's mojo/ package taken when the module starts. The module fixture runs
4 processes at once on an empty cache (the concurrency test); the other tests work on the cache it
leaves, restored at the same path before each. MAX's own cache (MODULAR_CACHE_DIR) is left alone, so
the repeat graph compiles are MAX cache hits (it keys on the .mojoc's path); fusekit's counters and
progress lines count fusekit's compiles.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("max.engine", reason="MAX is not importable")  # (binding `max` would shadow max())

from fusekit.backends.mojo import runtime as rt

REPO = Path(__file__).resolve().parents[1]
PYTHON_DIR = REPO / "python"
TESTS_DIR = REPO / "tests"
COLD_TIMEOUT = 1500  # s: package precompile + one graph compile, 4 processes on 2 cores
STEP_TIMEOUT = 900  # s: at most one precompile + one graph compile
DENY_ENV = "FUSEKIT_TEST_DENY_WRITES"  # child only: every write under this dir fails with EACCES
BACKEND_ENV = "FUSEKIT_TEST_BACKEND"  # child only: also report MojoBackend.unavailable_reason()
TOL = 2e-5  # CONTRACT.md, fp32

# Simulates a read-only directory for a process running as root (where chmod does not stop
# writes): the os/io primitives the runtime, tempfile and pathlib write through refuse any path
# inside $FUSEKIT_TEST_DENY_WRITES, as the kernel would for a read-only dir.
DENY_WRITES = r"""
import builtins, errno, io, os
_root = os.path.realpath(os.environ["FUSEKIT_TEST_DENY_WRITES"])

def _inside(p):
    try:
        r = os.path.realpath(os.fsdecode(os.fspath(p)))
    except TypeError:
        return False
    return r == _root or r.startswith(_root + os.sep)

def _deny(p):
    raise PermissionError(errno.EACCES, "Permission denied (simulated read-only dir)", os.fspath(p))

def _guard(fn, nargs=1):
    def guarded(*a, **k):
        for p in a[:nargs]:
            if _inside(p):
                _deny(p)
        return fn(*a, **k)
    return guarded

for _name, _n in (("mkdir", 1), ("unlink", 1), ("remove", 1), ("rmdir", 1), ("replace", 2), ("rename", 2)):
    setattr(os, _name, _guard(getattr(os, _name), _n))
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_os_open = os.open

def _open_guarded(p, flags, *a, **k):
    if flags & _WRITE and _inside(p):
        _deny(p)
    return _os_open(p, flags, *a, **k)

os.open = _open_guarded
_io_open = io.open

def _io_open_guarded(file, mode="r", *a, **k):
    if any(c in mode for c in "wax+") and _inside(file):
        _deny(file)
    return _io_open(file, mode, *a, **k)

builtins.open = io.open = _io_open_guarded
"""

# One child: reduce_sum float32 on the CPU through OpCompiler + Dispatcher; prints one RESULT line.
CHILD = r"""
import json, os, sys, warnings
if os.environ.get("FUSEKIT_TEST_DENY_WRITES"):
    exec(sys.argv[2])
import torch
from checks import rel_error, sum_scale
from fusekit.backends.mojo import runtime as rt
from fusekit.backends.mojo.dispatch import Dispatcher
from fusekit.backends.mojo.specs import SPECS

pkg = sys.argv[1]
res = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    if os.environ.get("FUSEKIT_TEST_BACKEND"):
        from fusekit.backends.mojo import MojoBackend
        res["unavailable"] = MojoBackend(pkg).unavailable_reason()
    comp = rt.OpCompiler(pkg)
    spec = SPECS["reduce_sum"]
    torch.manual_seed(0)
    x = torch.randn(37, 53)
    out = torch.full((37,), float("nan"))
    outs, ins, params = spec.bind((out,), (x,), (torch.float32,))
    cpu = torch.device("cpu")
    compiled = comp.get(spec, spec.dtype_key(outs, ins), cpu)
    disp = Dispatcher()
    disp.run(compiled, disp.state(cpu), outs, ins, params)
res["err"] = rel_error(out, x.double().sum(-1), sum_scale(x, -1))
res["stats"] = {k: v for k, v in vars(comp.stats).items() if k != "seconds"}
res["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
print("RESULT " + json.dumps(res), flush=True)
"""


@dataclass
class Run:
    rc: int | None  # None: killed after its timeout
    res: dict
    stderr: str

    @property
    def progress(self) -> list[str]:
        return [ln for ln in self.stderr.splitlines() if ln.startswith("fusekit: ")]

    @property
    def warnings(self) -> list[str]:
        return self.res.get("warnings", [])

    def check(self) -> None:
        """The process finished and its result is right."""
        assert self.rc == 0 and self.res, f"child failed (rc {self.rc}):\n{self.stderr[-4000:]}"
        assert self.res["err"] < TOL, self.res


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (rt.QUIET_ENV, rt.PACKAGE_ENV, DENY_ENV)}
    paths = [str(PYTHON_DIR), str(TESTS_DIR), env.get("PYTHONPATH", "")]
    env.update(PYTHONPATH=os.pathsep.join(p for p in paths if p), **{rt.CACHE_ENV: str(cache)}, **extra)
    return env


def _start(pkg: Path, cache: Path, **extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(pkg), DENY_WRITES],
        env=_env(cache, **extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen, deadline: float) -> Run:
    try:
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        rc = None
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    return Run(rc, json.loads(lines[-1][7:]) if lines else {}, err)


def _run(pkg: Path, cache: Path, **extra: str) -> Run:
    return _finish(_start(pkg, cache, **extra), time.monotonic() + STEP_TIMEOUT)


@dataclass
class Cold:
    pkg: Path
    cache: Path  # the cache dir every test works in (restored from `pristine` by `_fresh`)
    pristine: Path  # the cache the cold processes left
    runs: list[Run]


@pytest.fixture(scope="module")
def cold(tmp_path_factory: pytest.TempPathFactory) -> Cold:
    """4 processes started at once on an empty cache, over a copy of the repo's mojo/ package."""
    root = tmp_path_factory.mktemp("mojo_cache")
    pkg = root / "pkg"
    pkg.mkdir()
    for f in rt.package_files(REPO / "mojo"):
        shutil.copy2(f, pkg / f.name)
    cache = root / "cache"
    procs = [_start(pkg, cache) for _ in range(4)]
    deadline = time.monotonic() + COLD_TIMEOUT
    try:
        runs = [_finish(p, deadline) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    shutil.copytree(cache, root / "pristine")
    return Cold(pkg, cache, root / "pristine", runs)


def _fresh(cold: Cold) -> Path:
    """The cold processes' cache, restored at the path they used: MAX's own compile cache keys on
    the .mojoc's path, so a graph compiled from this path again is a MAX cache hit (seconds)."""
    for run in cold.runs:
        run.check()
    shutil.rmtree(cold.cache)
    shutil.copytree(cold.pristine, cold.cache)
    return cold.cache


def _only(paths: list[Path]) -> Path:
    assert len(paths) == 1, paths
    return paths[0]


# --- tests without a compile -----------------------------------------------------------------------
def test_sealed_file_damage_is_detected(tmp_path: Path) -> None:
    staged = tmp_path / "stage"
    staged.mkdir()
    (staged / "a.mef").write_bytes(os.urandom(3000))
    final = tmp_path / "a.mef"
    rt._seal(staged / "a.mef", final)
    assert rt._damage(final) is None
    data = final.read_bytes()
    final.write_bytes(data[:1000])
    assert "truncated" in rt._damage(final)
    final.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    assert "sha256" in rt._damage(final)
    final.write_bytes(data)
    assert rt._damage(final) is None
    rt._sum_path(final).unlink()
    assert ".sum" in rt._damage(final)


def test_sealed_files_are_readable_by_other_users(tmp_path: Path) -> None:
    """The .sum (and an artifact copied in after a fallback) get a new file's usual mode, not mkstemp's
    0600: a cache dir built by one user (an image prebuilt by mojo_build) read as damaged by all others."""
    old = os.umask(0o022)
    try:
        for staged_here in (True, False):
            d = tmp_path / ("here" if staged_here else "elsewhere")
            stage = (d if staged_here else tmp_path / "other") / ".stage-x"
            stage.mkdir(parents=True)
            (stage / "a.mef").write_bytes(b"model")
            d.mkdir(exist_ok=True)
            rt._seal(stage / "a.mef", d / "a.mef")
            for f in (d / "a.mef", rt._sum_path(d / "a.mef")):
                assert stat.S_IMODE(f.stat().st_mode) & 0o044 == 0o044, (f, oct(f.stat().st_mode))
    finally:
        os.umask(old)


@pytest.mark.parametrize(
    "failure",
    [
        OSError(28, "No space left on device"),
        rt.MojoBuildError(
            "`mojo precompile x` failed (exit 1):\nLLVM ERROR: IO failure on output stream: "
            "No space left on device"
        ),
    ],
    ids=["oserror", "precompile"],
)
def test_full_cache_dir_falls_back_to_a_private_dir(tmp_path: Path, failure: Exception) -> None:
    """A staging write the shared dir refuses (full disk, quota) is a cache failure like an unwritable dir:
    one warning naming the env var, then the write is redone in the private dir; it raised before."""
    store = rt._Store(tmp_path / "cache")
    rel = Path("fusekit_x.mojoc")
    calls = []

    def write(out: Path) -> None:
        calls.append(out)
        if len(calls) == 1:
            raise failure
        out.write_bytes(b"package")

    with pytest.warns(RuntimeWarning, match=rt.CACHE_ENV):
        path = store.save(rel, write)
    assert (
        path.read_bytes() == b"package" and store.private is not None and path.is_relative_to(store.private)
    )
    assert calls[0].is_relative_to(tmp_path / "cache") and not list((tmp_path / "cache").glob(".stage-*"))


def test_a_build_error_is_not_read_as_a_cache_failure(tmp_path: Path) -> None:
    store = rt._Store(tmp_path / "cache")

    def write(out: Path) -> None:
        raise rt.MojoBuildError("`mojo precompile x` failed (exit 1):\nerror: use of unknown declaration 'y'")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(rt.MojoBuildError, match="unknown declaration"):
            store.save(Path("fusekit_x.mojoc"), write)
    assert store.private is None and store.failed is None


def test_staging_dirs_of_killed_processes_are_swept(tmp_path: Path) -> None:
    """A process killed mid-build leaves its .stage-* dir (its `mojo precompile` child may even finish
    into it); the next save removes those older than STAGE_MAX_AGE_S and leaves a recent one alone."""
    cache = tmp_path / "cache"
    old, recent = cache / ".stage-old", cache / ".stage-recent"
    for d in (old, recent):
        (d / "fusekit_ops").mkdir(parents=True)
    t = time.time() - rt.STAGE_MAX_AGE_S - 60
    os.utime(old, (t, t))
    rt._Store(cache).save(Path("fusekit_x.mojoc"), lambda out: out.write_bytes(b"package"))
    assert not old.exists() and recent.is_dir() and (cache / "fusekit_x.mojoc").is_file()


def test_cpu_mefs_are_named_for_the_host_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU machine code depends on the host's ISA extensions: the tag names the architecture and hashes
    the feature flags, so a cache dir shared between hosts never hands one host's MEF to another."""
    import platform

    import torch

    tag = rt.device_tag(torch.device("cpu"))
    machine = platform.machine() or "unknown"
    assert tag.startswith(f"cpu-{machine}-") and len(tag.rsplit("-", 1)[1]) == 8, tag
    real_open = open

    def fake_cpuinfo(path, *a, **k):
        if str(path) == "/proc/cpuinfo":
            import io

            return io.StringIO("processor : 0\nflags : fpu sse2 avx2\n")
        return real_open(path, *a, **k)

    rt._cpu_tag.cache_clear()
    monkeypatch.setattr("builtins.open", fake_cpuinfo)
    try:
        other = rt._cpu_tag()
    finally:
        monkeypatch.undo()
        rt._cpu_tag.cache_clear()
    assert other.startswith(f"cpu-{machine}-") and other != tag


def test_construction_touches_no_cache_and_precompile_names_the_env_var(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Constructing OpCompiler must not fail for a cache problem (the backend reads any failure
    there as "MAX is not installed"); the public precompile() raises a CacheDirError naming
    FUSEKIT_CACHE_DIR. (A dir under a regular file is uncreatable even for root.)"""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(rt.CACHE_ENV, str(blocker / "cache"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        comp = rt.OpCompiler(REPO / "mojo")
    assert comp.cache == blocker / "cache" and comp.stats.precompiles == 0
    with pytest.raises(rt.CacheDirError, match=rt.CACHE_ENV):
        rt.cache_dir()
    with pytest.raises(rt.CacheDirError, match=rt.CACHE_ENV):
        rt.precompile(REPO / "mojo", comp.digest, blocker / "cache")


LOCK_CHILD = r"""
import sys, time
from pathlib import Path
from fusekit.backends.mojo import runtime as rt
store = rt._Store(Path(sys.argv[1]), stats=rt.Stats())
rel = Path("mef") / "x" / "op.mef"

def build(damaged):
    with open(sys.argv[2], "a") as f:
        f.write("build\n")
    time.sleep(1.5)
    return store.save(rel, lambda out: out.write_bytes(b"model" * 100)).read_bytes()

value, built = rt._obtain(store, rel, "to finish compiling op", lambda p: p.read_bytes(), build)
assert value == b"model" * 100
print(f"built={int(built)} waits={store.stats.lock_waits}")
"""


def test_lock_gives_one_build_across_processes(tmp_path: Path) -> None:
    """The file lock alone (no MAX): 4 processes at once, one build, the others load its result."""
    log = tmp_path / "builds.log"
    env = _env(tmp_path / "cache")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", LOCK_CHILD, str(tmp_path / "cache"), str(log)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(out.strip())
    assert log.read_text().count("build") == 1, outs
    assert sorted(o.split()[0] for o in outs) == ["built=0"] * 3 + ["built=1"], outs


# --- tests through MAX -----------------------------------------------------------------------------
def test_concurrent_cold_processes_share_one_compile(cold: Cold) -> None:
    for run in cold.runs:
        run.check()
    stats = [run.res["stats"] for run in cold.runs]
    assert sum(s["precompiles"] for s in stats) == 1, stats
    assert sum(s["graph_compiles"] for s in stats) == 1, stats
    assert sum(s["mef_loads"] for s in stats) == 3, stats
    progress = [ln for run in cold.runs for ln in run.progress]
    assert sum("fusekit: compiling mojo" in ln for ln in progress) == 1, progress
    assert sum("fusekit: precompiling the mojo op package" in ln for ln in progress) == 1, progress
    assert not [w for run in cold.runs for w in run.warnings]


def test_progress_lines_on_a_cold_compile_not_on_a_hit(cold: Cold) -> None:
    compiler = _only([run for run in cold.runs if run.res.get("stats", {}).get("graph_compiles")])
    text = "\n".join(compiler.progress)
    assert "fusekit: precompiling the mojo op package" in text and "first use" in text, text
    assert "fusekit: precompiled the mojo op package's unit reduce_sum in " in text, text
    assert "fusekit: compiling mojo reduce_sum (float32, cpu) — first use, cached in " in text, text
    assert "fusekit: compiled mojo reduce_sum (float32, cpu) in " in text, text
    warm = _run(cold.pkg, _fresh(cold))
    warm.check()
    assert warm.res["stats"]["mef_loads"] == 1 and warm.res["stats"]["graph_compiles"] == 0
    assert warm.progress == [] and warm.warnings == [], (warm.progress, warm.warnings)


def test_truncated_mojoc_is_rebuilt_with_a_warning(cold: Cold) -> None:
    cache = _fresh(cold)
    mojoc = _only(list(cache.glob("fusekit_*.mojoc")))
    mojoc.write_bytes(mojoc.read_bytes()[: mojoc.stat().st_size // 2])
    shutil.rmtree(cache / "mef")  # else the MEF is loaded and the package is never read
    run = _run(cold.pkg, cache)
    run.check()
    assert any(w.startswith("RuntimeWarning") and str(mojoc) in w for w in run.warnings), run.warnings
    s = run.res["stats"]
    assert s["rebuilds"] == 1 and s["precompiles"] == 1 and s["graph_compiles"] == 1, s
    assert any("precompiling" in ln and "damaged" in ln for ln in run.progress), run.progress
    again = _run(cold.pkg, cache)  # repaired for good: the next process just loads
    again.check()
    assert again.warnings == [] and again.res["stats"]["mef_loads"] == 1, again.res


def test_truncated_mef_is_rebuilt_with_a_warning_quietly(cold: Cold) -> None:
    cache = _fresh(cold)
    mef = _only(list(cache.glob("mef/*/*.mef")))
    mef.write_bytes(mef.read_bytes()[:100])
    run = _run(cold.pkg, cache, **{rt.QUIET_ENV: "1"})
    run.check()
    assert any(w.startswith("RuntimeWarning") and str(mef) in w for w in run.warnings), run.warnings
    s = run.res["stats"]
    assert s["rebuilds"] == 1 and s["graph_compiles"] == 1 and s["precompiles"] == 0, s
    assert run.progress == [], run.progress  # FUSEKIT_QUIET=1
    again = _run(cold.pkg, cache)
    again.check()
    assert again.warnings == [] and again.res["stats"]["mef_loads"] == 1, again.res


def test_unwritable_cache_dir_falls_back_and_keeps_the_compile(cold: Cold) -> None:
    """A read-only cache with the package but no MEF: the .mojoc is read from it, the new MEF goes
    to a private dir with a warning naming FUSEKIT_CACHE_DIR, the result is right."""
    cache = _fresh(cold)
    shutil.rmtree(cache / "mef")
    before = sorted(str(p.relative_to(cache)) for p in cache.rglob("*"))
    paths = [cache, *cache.rglob("*")]
    for p in paths:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        # chmod does not stop root: then the child refuses the writes itself
        extra = {DENY_ENV: str(cache)} if os.access(cache, os.W_OK) else {}
        run = _run(cold.pkg, cache, **extra)
    finally:
        for p in paths:
            p.chmod(p.stat().st_mode | stat.S_IWUSR)
    run.check()
    assert any(rt.CACHE_ENV in w and str(cache) in w for w in run.warnings), run.warnings
    s = run.res["stats"]
    assert s["graph_compiles"] == 1 and s["precompiles"] == 0, s
    assert sorted(str(p.relative_to(cache)) for p in cache.rglob("*")) == before


def test_uncreatable_cache_dir_warns_and_compiles(cold: Cold, tmp_path: Path) -> None:
    """FUSEKIT_CACHE_DIR that cannot be created: the backend is available (no install hint), the
    op compiles into a private dir, and the warning names FUSEKIT_CACHE_DIR."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    run = _run(cold.pkg, blocker / "cache", **{BACKEND_ENV: "1"})
    run.check()
    assert run.res["unavailable"] is None, run.res
    assert any(rt.CACHE_ENV in w and str(blocker / "cache") in w for w in run.warnings), run.warnings
    assert "pip install" not in run.stderr + json.dumps(run.res)
    s = run.res["stats"]
    assert s["precompiles"] == 1 and s["graph_compiles"] == 1, s
    assert any("for this process only" in ln for ln in run.progress), run.progress
