"""The reliability record (issue #15, item 7): pytest JUnit XML and sanitizer logs -> one JSON.

    python tests/reliability.py --out benchmarks/results/<slug>/reliability.json FILE.xml FILE.log ...

Inputs are what tests/run_gpu.sh and tests/sanitize_gpu.sh leave in $OUT (both call this at the end):
- `*.xml`: pytest `--junitxml` files. Each test case counts for the check named after its test file
  (tests/test_cuda_graphs.py -> "CUDA graphs"; see CHECKS), except in a sanitizer run
  (`sanitize-<backend>-<tool>[-<what>].xml`), where every case counts for "sanitizer <tool>".
- `*.log`: pytest's console log of the same stem. Its sanitizer summary ("ERROR SUMMARY: N errors",
  racecheck's "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)") and the exit code that
  sanitize_gpu.sh appends ("exit=N") are added to that check; a log without an XML (pytest died before
  writing it) contributes the counts of pytest's last summary line instead.
Backend: the test id's backend parameter ([...-triton]), else the run's (from the XML suite name
`<backend>-<device>` that the scripts set with `-o junit_suite_name=...`, else the file name, else
--backend). Device likewise (suite name, else --device; sanitizer runs are CUDA).
Meta: commit (FUSEKIT_GIT_COMMIT, else `git rev-parse HEAD`), dirty flag, date, GPU, versions; or, with
--meta-from RECORD, those of a record written on the GPU machine (for logs of several device calls collected
here, where this machine's own GPU and versions would be wrong), its command and inputs replaced.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

BACKENDS = ("torch", "triton", "mojo")
DEVICES = ("cpu", "cuda")
CHECKS = {  # test file -> check name (others: the file name without test_, underscores as spaces)
    "test_conformance": "conformance",
    "test_hostile_inputs": "hostile inputs",
    "test_fuzz": "fuzz",
    "test_large_index": "large inputs",
    "test_cuda_graphs": "CUDA graphs",
    "test_out_of_memory": "out of memory",
    "test_concurrency": "concurrency",
    "test_any_device": "any device",
}
COUNTS = ("cases", "passed", "failed", "skipped", "errors")
MAX_LISTED = 20  # failed / errored test ids kept per check
_SAN_STEM = re.compile(r"^sanitize-(?P<backend>[a-z]+)-(?P<tool>[a-z]+)(?:-(?P<what>[\w-]+))?$")
_RUN_STEM = re.compile(r"^(?:tests|junit)-(?P<backend>[a-z]+)$")


def check_name(classname: str) -> str:
    """'tests.test_cuda_graphs' (or 'test_cuda_graphs.TestX') -> 'CUDA graphs'."""
    module = next((p for p in classname.split(".") if p.startswith("test_")), classname.split(".")[-1])
    return CHECKS.get(module, module.removeprefix("test_").replace("_", " "))


def backend_of(test_name: str) -> str | None:
    """The backend parameter of a test id: 'test_op[None-rope-forward-float32-0-triton]' -> 'triton'."""
    m = re.search(r"\[(.*)\]$", test_name)
    found = [p for p in re.split(r"[-,]", m.group(1)) if p in BACKENDS] if m else []
    return found[-1] if found else None


def _outcome(case: ET.Element) -> str:
    tags = {c.tag for c in case}
    if "error" in tags:
        return "errors"
    if "failure" in tags:
        return "failed"
    if "skipped" in tags:
        return "skipped"
    return "passed"


def _run_of(stem: str, suite: str | None, backend: str | None, device: str | None) -> tuple[str, str]:
    """The run's (backend, device): XML suite name '<backend>-<device>', else the file name, else args."""
    b = d = None
    if suite and re.fullmatch(rf"({'|'.join(BACKENDS)})-({'|'.join(DEVICES)})", suite):
        b, d = suite.split("-")
    san, run = _SAN_STEM.match(stem), _RUN_STEM.match(stem)
    m = san or run
    if m and m.group("backend") in BACKENDS:
        b = b or m.group("backend")
    if san:
        d = d or "cuda"  # compute-sanitizer runs on a GPU only
    return b or backend or "-", d or device or "-"


def _sanitizer(text: str) -> dict:
    """compute-sanitizer's summary lines and the exit code sanitize_gpu.sh appends, summed over the log."""
    # the sanitizer's own lines start with "=========" (the copy in the line the script appends does not)
    errs = [int(n) for n in re.findall(r"^=+ ERROR SUMMARY: (\d+) error", text, re.M)]
    races = re.findall(
        r"^=+ RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)", text, re.M
    )
    out: dict = {}
    if errs or races:
        out["sanitizer_errors"] = max(sum(errs), sum(int(e) for _, e, _ in races))
    if races:
        out["sanitizer_warnings"] = sum(int(w) for _, _, w in races)
    codes = [int(c) for c in re.findall(r"\bexit=(\d+)", text)]
    if codes:
        out["exit_code"] = codes[-1]
    return out


def _pytest_counts(text: str) -> dict[str, int] | None:
    """Counts from pytest's last summary line ('12 passed, 3 skipped in 4.5s'), or None."""
    lines = [  # not the sanitizer's "ERROR SUMMARY: 0 errors" nor the line the script appends with it
        ln
        for ln in text.splitlines()
        if re.search(r"\d+ (passed|failed|errors?|skipped)\b.* in [\d.]+s", ln) and "SUMMARY" not in ln
    ]
    if not lines:
        return None
    c = {k: 0 for k in COUNTS}
    for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", lines[-1]):
        key = {"error": "errors", "xfailed": "skipped", "xpassed": "passed"}.get(what, what)
        c[key] += int(n)
    c["cases"] = c["passed"] + c["failed"] + c["skipped"] + c["errors"]
    return c


def collect(
    paths: list[Path], backend: str | None = None, device: str | None = None
) -> tuple[list[dict], list[str]]:
    """One row per (check, backend, device) with counts, sanitizer findings, sources and failures;
    and the start times of the pytest runs (the XML suites' timestamps)."""
    started: list[str] = []
    rows: dict[tuple[str, str, str], dict] = {}

    def row(check: str, b: str, d: str) -> dict:
        key = (check, b, d)
        if key not in rows:
            rows[key] = {"check": check, "backend": b, "device": d, **dict.fromkeys(COUNTS, 0)}
            rows[key].update(sources=[], failures=[])
        return rows[key]

    by_stem: dict[str, dict[str, Path]] = defaultdict(dict)
    for p in paths:
        by_stem[p.stem][p.suffix] = p
    for stem, files in sorted(by_stem.items()):
        san = _SAN_STEM.match(stem)
        log = files[".log"].read_text(errors="replace") if ".log" in files else ""
        touched: list[dict] = []
        if ".xml" in files:
            root = ET.parse(files[".xml"]).getroot()
            for suite in root.iter("testsuite"):
                if suite.get("timestamp"):
                    started.append(suite.get("timestamp"))
                b_run, d_run = _run_of(stem, suite.get("name"), backend, device)
                for case in suite.iter("testcase"):
                    name = case.get("name", "?")
                    # a module skipped at collection has classname "" and its module path as the name
                    where = case.get("classname") or name
                    check = f"sanitizer {san.group('tool')}" if san else check_name(where)
                    r = row(check, backend_of(name) or b_run, d_run)
                    outcome = _outcome(case)
                    r["cases"] += 1
                    r[outcome] += 1
                    if outcome in ("failed", "errors") and len(r["failures"]) < MAX_LISTED:
                        r["failures"].append(f"{case.get('classname')}::{name}")
                    if files[".xml"].name not in r["sources"]:
                        r["sources"].append(files[".xml"].name)
                        touched.append(r)
        elif log:  # no XML: pytest's own summary line
            counts = _pytest_counts(log)
            b_run, d_run = _run_of(stem, None, backend, device)
            r = row(f"sanitizer {san.group('tool')}" if san else f"{stem} (no JUnit XML)", b_run, d_run)
            r["sources"].append(files[".log"].name)
            touched.append(r)
            if counts is None:
                r["errors"] += 1  # no result at all: count the run as one error
                r["cases"] += 1
                r["failures"].append(f"{stem}: no pytest summary in the log")
            else:
                for k in COUNTS:
                    r[k] += counts[k]
        if log and san:
            found = _sanitizer(log)
            for r in touched or [
                row(f"sanitizer {san.group('tool')}", *_run_of(stem, None, backend, device))
            ]:
                for k, v in found.items():
                    r[k] = max(r.get(k, 0), v) if k == "exit_code" else r.get(k, 0) + v
                if ".log" in files and files[".log"].name not in r["sources"]:
                    r["sources"].append(files[".log"].name)
    return list(rows.values()), sorted(started)


def meta(inputs: list[Path], argv: list[str], meta_from: Path | None = None) -> dict:
    """Commit, date, GPU and versions of the machine writing the record (fusekit.bench's environment), or
    of the record `meta_from`; then this call's command and inputs."""
    if meta_from is not None:
        m = dict(json.loads(meta_from.read_text())["meta"], meta_from=meta_from.name)
    else:
        import torch

        from fusekit.bench import results

        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        m = results.environment(dev)
        m.update(
            schema="fusekit-reliability/1",
            gpu_count=torch.cuda.device_count() if dev.type == "cuda" else 0,
        )
    m.update(command=" ".join(["python tests/reliability.py", *argv]), inputs=[p.name for p in inputs])
    return m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="the JSON to write")
    ap.add_argument(
        "--backend", choices=BACKENDS, help="backend of runs that do not say (default: from names)"
    )
    ap.add_argument(
        "--device", choices=DEVICES, help="device of every run (default: from the XML suite name)"
    )
    ap.add_argument("--meta-from", type=Path, help="take commit, GPU and versions from this record")
    ap.add_argument("inputs", nargs="+", type=Path, help="pytest JUnit XML files and their .log files")
    args = ap.parse_args(argv)
    inputs = [p for p in args.inputs if p.suffix in (".xml", ".log") and p.is_file()]
    if not inputs:
        print("reliability: no .xml or .log file among the inputs", file=sys.stderr)
        return 1
    checks, started = collect(inputs, args.backend, args.device)
    totals = {k: sum(r[k] for r in checks) for k in COUNTS}
    argv = sys.argv[1:] if argv is None else argv
    doc = {"meta": meta(inputs, argv, args.meta_from), "checks": checks, "totals": totals}
    doc["meta"]["runs_started"] = started[0] if started else None  # the first pytest run's start (XML)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(
        f"reliability: {len(checks)} checks, {totals['cases']} cases, {totals['passed']} passed, "
        f"{totals['failed']} failed, {totals['errors']} errors, {totals['skipped']} skipped, "
        f"{sum(r.get('sanitizer_errors', 0) for r in checks)} sanitizer errors -> {args.out}"
    )
    return 0  # a recorder: the test runs' own exit codes say pass or fail


if __name__ == "__main__":
    sys.exit(main())
