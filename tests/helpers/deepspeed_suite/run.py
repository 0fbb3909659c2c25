"""``python -m tests.helpers.deepspeed_suite.run DEEPSPEED_SRC [FILE ...]`` (``launch/deepspeed_tests.sh``): run
DeepSpeed's unit tests from a source tree at the installed release's tag, each file twice (stock, then with
ds_tensorshard forced on for every stage-1/2 engine and every stage-3 config: :mod:`.forcing`), and print its tables
(:mod:`.table`) as soon as both runs end.

FILEs are relative to ``DEEPSPEED_SRC/tests`` (``unit/v1/zero/test_zero.py``); without any, the selection: every
test file under ``tests/unit`` that configures ZeRO (mentions ``zero_optimization`` or ``zero_stage``), but for the
inference and hybrid-engine folders. Each pytest run is a process of its own (a hang that DeepSpeed's harness ends
with ``pytest.exit`` ends one file's run only); its log, the engine records and the results are kept under
``--out``, and ``--resume`` reuses the runs already there.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

from tests.helpers import ROOT
from tests.helpers.deepspeed_suite.events import EVENTS, MODE
from tests.helpers.deepspeed_suite.results import PRELOAD, RESULTS
from tests.helpers.deepspeed_suite.table import STAGES, file_row, format_rows, kinds, load, report, result_path

SITE = os.path.join(ROOT, "tests", "helpers", "deepspeed_suite", "site")
EXCLUDED = ("unit/inference/", "unit/hybrid_engine/")  # no ZeRO-1/2 training to compare
ZERO = re.compile(r"zero_optimization|zero_stage")


def selection(tests: Path) -> list[str]:
    """The default files: every test module under unit/ that configures ZeRO, but for EXCLUDED."""
    found = []
    for path in sorted((tests / "unit").rglob("test_*.py")):
        name = path.relative_to(tests).as_posix()
        if not name.startswith(EXCLUDED) and ZERO.search(path.read_text(errors="replace")):
            found.append(name)
    return found


def check_tree(src: Path, any_version: bool) -> Path:
    """DEEPSPEED_SRC's tests folder, once its version.txt is the installed DeepSpeed's release."""
    tests = src / "tests"
    if not (tests / "unit" / "common.py").exists():
        sys.exit(f"{src} is not a DeepSpeed source tree (no tests/unit/common.py); see docs/testing.md")
    installed = version("deepspeed")
    tree = (src / "version.txt").read_text().strip() if (src / "version.txt").exists() else "unknown"
    if tree != installed:
        message = f"{src} is DeepSpeed {tree}, the installed DeepSpeed is {installed}"
        if not any_version:
            sys.exit(f"{message}: check out the tag v{installed} (docs/testing.md), or pass --any-version")
        print(f"warning: {message} (--any-version)", flush=True)
    return tests


def environment(out: Path, mode: str, name: str, ranks: int, preload: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("DS_TENSORSHARD", None)
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (SITE, ROOT, os.environ.get("PYTHONPATH")) if p),
        DS_ACCELERATOR="cpu",
        LOCAL_SIZE=str(ranks),  # the CPU accelerator's device count: tests wanting more ranks skip
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        DS_TENSORSHARD_TEST_CPUINFO=str(out / "cpuinfo.json"),
    )
    results = result_path(out, mode, name)
    env.update({MODE: mode, EVENTS: str(results.with_suffix(".events")), RESULTS: str(results)})
    env[PRELOAD] = "1" if preload else "0"
    if mode == "plugin":
        env["DS_TENSORSHARD"] = "1"
    return env


def run_file(tests: Path, out: Path, mode: str, name: str, targets: list[str], options: argparse.Namespace) -> float:
    """One pytest run of ``targets`` (the file, or some of its tests) of one file; the seconds it took, also written
    to its ``.done`` file, which ``--resume`` looks for."""
    results = result_path(out, mode, name)
    results.parent.mkdir(parents=True, exist_ok=True)
    for stale in (results, results.with_suffix(".events"), results.with_suffix(".done")):
        stale.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-p", "tests.helpers.deepspeed_suite.results", "-p", "no:cacheprovider"]
    env = environment(out, mode, name, options.ranks, not options.no_preload)
    start = time.monotonic()
    if targets:
        with open(results.with_suffix(".log"), "w") as log:
            extra = shlex.split(options.pytest_args)
            subprocess.run([*command, *extra, *targets], cwd=tests, env=env, stdout=log, stderr=log)
    results.touch()
    seconds = time.monotonic() - start
    results.with_suffix(".done").write_text(f"{seconds:.0f}\n")
    return seconds


def plugin_targets(out: Path, name: str, every_test: bool) -> list[str]:
    """What the plugin run of a file runs: the file, or (by default) only its tests that passed stock and engaged
    ZeRO stage 1/2 or 3, the only ones its tables read the plugin run for."""
    if every_test:
        return [name]
    counted = set().union(*(stock_kinds for stock_kinds, _ in STAGES.values()))
    stock = load(result_path(out, "stock", name))
    return [nodeid for nodeid, result in stock.items() if result["outcome"] == "passed" and kinds(result) & counted]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="launch/deepspeed_tests.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="a DeepSpeed source tree at the installed release's tag")
    parser.add_argument("files", nargs="*", help="test files relative to SRC/tests (default: the selection)")
    parser.add_argument("--out", type=Path, default=Path(ROOT, "runs", "deepspeed_tests"))
    parser.add_argument("--ranks", type=int, default=4, help="CPU ranks a test may use (LOCAL_SIZE; default 4)")
    parser.add_argument("--resume", action="store_true", help="keep the runs already in --out")
    parser.add_argument("--modes", nargs="+", choices=("stock", "plugin"), default=["stock", "plugin"])
    parser.add_argument("--any-version", action="store_true", help="run a tree of another release (warns)")
    parser.add_argument(
        "--no-preload", action="store_true", help="ranks import deepspeed themselves (default: forked with it)"
    )
    parser.add_argument(
        "--plugin-every-test",
        action="store_true",
        help="the plugin run runs every test (default: only those that passed stock and engaged ZeRO-1/2 or 3)",
    )
    parser.add_argument("--pytest-args", default="", help="more pytest arguments, e.g. \"-k 'stage and 2'\"")
    args = parser.parse_args(argv)
    tests = check_tree(args.src.resolve(), args.any_version)
    files = args.files or selection(tests)
    print(f"{len(files)} files, {args.ranks} CPU ranks, results in {args.out}", flush=True)
    seconds = {"stock": 0.0, "plugin": 0.0}
    for name in files:
        for mode in args.modes:
            if args.resume and result_path(args.out, mode, name).with_suffix(".done").exists():
                continue
            targets = [name] if mode == "stock" else plugin_targets(args.out, name, args.plugin_every_test)
            seconds[mode] += run_file(tests, args.out, mode, name, targets, args)
        stock, plugin = load(result_path(args.out, "stock", name)), load(result_path(args.out, "plugin", name))
        for stage in STAGES:
            print(format_rows([(f"{name} (stage {stage})", file_row(stock, plugin, stage)[0])]), flush=True)
    print("\n" + report(args.out, files))
    print(f"\ntime: stock {seconds['stock']:.0f} s, plugin {seconds['plugin']:.0f} s (this invocation's runs)")


if __name__ == "__main__":
    main()
