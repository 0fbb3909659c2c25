"""The tables of a DeepSpeed-suite run, one for ZeRO stages 1/2 and one for stage 3: per test file, how the tests
that pass stock and engage the stage fare with ds_tensorshard forced on.

Columns: ``selected`` (tests pytest collected), ``stock pass`` (passed stock), ``stock ZeRO-1/2`` (passed stock and
built a stage-1/2 engine with an optimizer) or ``stock ZeRO-3`` (passed stock and built a stage-3 engine, or a
``zero.Init`` with a stage-3 config: a stage-3 engine makes one to convert its model), then of those, in the plugin
run: ``engaged`` (ds_tensorshard built the optimizer or converted the ``zero.Init``'s parameters, or refused the
config), ``pass``, ``refused`` (a ``TensorShardConfigError`` at ``deepspeed.initialize``, the test failing),
``fail`` (any other failure) and ``not engaged`` (ds_tensorshard built nothing: the forcing did not reach it).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# stage -> (the stock run's records that count a test in, the plugin run's that show the plugin engaged)
STAGES = {"1/2": ({"zero12"}, {"engaged", "refused"}), "3": ({"zero3", "init3"}, {"engaged3", "owned3", "refused"})}


def columns(stage: str = "1/2") -> tuple[str, ...]:
    return ("selected", "stock pass", f"stock ZeRO-{stage}", "engaged", "pass", "refused", "fail", "not engaged")


def load(path: Path) -> dict[str, dict[str, Any]]:
    """nodeid -> the test's line of a results file (:mod:`.results`); {} where there is none."""
    if not path.exists():
        return {}
    lines = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {line["nodeid"]: line for line in lines}


def kinds(result: dict[str, Any] | None) -> set[str]:
    return {kind for kind, _ in (result or {}).get("events", [])}


def verdict(plugin: dict[str, Any] | None, stage: str = "1/2") -> str:
    """How a test that passes stock and engages ``stage`` fares in the plugin run."""
    seen = kinds(plugin)
    if plugin is None or not seen & STAGES[stage][1]:
        return "not engaged"
    if plugin["outcome"] == "passed":
        return "pass"
    return "refused" if "refused" in seen else "fail"


def file_row(
    stock: dict[str, dict], plugin: dict[str, dict], stage: str = "1/2"
) -> tuple[dict[str, int], list[tuple[str, str, str]]]:
    """The counts of one file for ``stage``, and (verdict, nodeid, message) for each test that passes stock and
    engages the stage but did not pass in the plugin run."""
    row = dict.fromkeys(columns(stage), 0)
    row["selected"] = len(stock)
    problems = []
    for nodeid, result in stock.items():
        if result["outcome"] != "passed":
            continue
        row["stock pass"] += 1
        if not kinds(result) & STAGES[stage][0]:
            continue
        row[f"stock ZeRO-{stage}"] += 1
        outcome = verdict(plugin.get(nodeid), stage)
        row["engaged"] += outcome != "not engaged"
        row[outcome] += 1
        if outcome != "pass":
            message = (plugin.get(nodeid) or {}).get("message", "no result in the plugin run")
            problems.append((outcome, nodeid, message))
    return row, problems


def format_rows(rows: Iterable[tuple[str, dict[str, int]]]) -> str:
    listed = list(rows)
    names = list(listed[0][1]) if listed else list(columns())
    lines = ["| file | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += [f"| {name} | " + " | ".join(str(row[c]) for c in names) + " |" for name, row in listed]
    return "\n".join(lines)


def report(out: Path, files: list[str]) -> str:
    """For each stage, every file's table (with its tests that did not pass) and the total, from a run's ``out``
    folder."""
    parts = []
    for stage in STAGES:
        parts.append(f"\n## ZeRO stage {stage}")
        total, rows = dict.fromkeys(columns(stage), 0), []
        for name in files:
            stock, plugin = load(result_path(out, "stock", name)), load(result_path(out, "plugin", name))
            row, problems = file_row(stock, plugin, stage)
            rows.append((name, row))
            total = {c: total[c] + row[c] for c in total}
            parts.append(format_rows([(name, row)]))
            parts += [f"  {outcome}: {nodeid}: {message}" for outcome, nodeid, message in problems]
        parts.append(f"\nall files, stage {stage}:\n" + format_rows([*rows, ("total", total)]))
    return "\n".join(parts)


def result_path(out: Path, mode: str, name: str) -> Path:
    return out / mode / (name.replace("/", "__") + ".jsonl")


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    names = sorted({p.name[: -len(".jsonl")].replace("__", "/") for p in (folder / "stock").glob("*.jsonl")})
    print(report(folder, names))
