"""The tables of a DeepSpeed-suite run: per test file, how the tests that pass stock and build a ZeRO stage 1/2
engine fare with ds_tensorshard forced on.

Columns: ``selected`` (tests pytest collected), ``stock pass`` (passed stock), ``stock ZeRO-1/2`` (passed stock and
built a stage-1/2 engine with an optimizer), then of those, in the plugin run: ``engaged`` (ds_tensorshard built
the optimizer, or refused the config), ``pass``, ``refused`` (a ``TensorShardConfigError`` at
``deepspeed.initialize``, the test failing), ``fail`` (any other failure) and ``not engaged`` (no ds_tensorshard
optimizer was built: the forcing did not reach the engine).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

COLUMNS = ("selected", "stock pass", "stock ZeRO-1/2", "engaged", "pass", "refused", "fail", "not engaged")


def load(path: Path) -> dict[str, dict[str, Any]]:
    """nodeid -> the test's line of a results file (:mod:`.results`); {} where there is none."""
    if not path.exists():
        return {}
    lines = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {line["nodeid"]: line for line in lines}


def kinds(result: dict[str, Any] | None) -> set[str]:
    return {kind for kind, _ in (result or {}).get("events", [])}


def verdict(plugin: dict[str, Any] | None) -> str:
    """How a test that passes stock with a ZeRO-1/2 engine fares in the plugin run."""
    seen = kinds(plugin)
    if plugin is None or not seen & {"engaged", "refused"}:
        return "not engaged"
    if plugin["outcome"] == "passed":
        return "pass"
    return "refused" if "refused" in seen else "fail"


def file_row(stock: dict[str, dict], plugin: dict[str, dict]) -> tuple[dict[str, int], list[tuple[str, str, str]]]:
    """The counts of one file, and (verdict, nodeid, message) for each stock ZeRO-1/2 test that did not pass."""
    row = dict.fromkeys(COLUMNS, 0)
    row["selected"] = len(stock)
    problems = []
    for nodeid, result in stock.items():
        if result["outcome"] != "passed":
            continue
        row["stock pass"] += 1
        if "zero12" not in kinds(result):
            continue
        row["stock ZeRO-1/2"] += 1
        outcome = verdict(plugin.get(nodeid))
        row["engaged"] += outcome != "not engaged"
        row[outcome] += 1
        if outcome != "pass":
            message = (plugin.get(nodeid) or {}).get("message", "no result in the plugin run")
            problems.append((outcome, nodeid, message))
    return row, problems


def format_rows(rows: Iterable[tuple[str, dict[str, int]]]) -> str:
    lines = ["| file | " + " | ".join(COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS)]
    lines += [f"| {name} | " + " | ".join(str(row[c]) for c in COLUMNS) + " |" for name, row in rows]
    return "\n".join(lines)


def report(out: Path, files: list[str]) -> str:
    """Every file's table (with its tests that did not pass) and the total, from a run's ``out`` folder."""
    parts, total = [], dict.fromkeys(COLUMNS, 0)
    rows = []
    for name in files:
        row, problems = file_row(load(result_path(out, "stock", name)), load(result_path(out, "plugin", name)))
        rows.append((name, row))
        total = {c: total[c] + row[c] for c in COLUMNS}
        parts.append(format_rows([(name, row)]))
        parts += [f"  {outcome}: {nodeid}: {message}" for outcome, nodeid, message in problems]
    parts.append("\nall files:\n" + format_rows([*rows, ("total", total)]))
    return "\n".join(parts)


def result_path(out: Path, mode: str, name: str) -> Path:
    return out / mode / (name.replace("/", "__") + ".jsonl")


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    names = sorted({p.name[: -len(".jsonl")].replace("__", "/") for p in (folder / "stock").glob("*.jsonl")})
    print(report(folder, names))
