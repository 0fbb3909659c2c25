"""A pytest plugin for DeepSpeed-suite runs (``-p tests.helpers.deepspeed_suite.results``): one JSON line per test
in ``DS_TENSORSHARD_SUITE_RESULTS`` with its outcome and the engine records (:mod:`.events`) its processes made.

Tests run one at a time (no xdist), so the records appended between a test's start and its end are that test's,
whichever rank wrote them (a DistributedTest's ranks and its DistributedFixtures' alike).
"""

from __future__ import annotations

import json
import multiprocessing
import os
from typing import Any

import pytest

from tests.helpers.deepspeed_suite.events import EVENTS, read_from

RESULTS = "DS_TENSORSHARD_SUITE_RESULTS"
PRELOAD = "DS_TENSORSHARD_SUITE_PRELOAD"  # "1": the forkserver imports deepspeed before forking ranks


def failure_message(report: pytest.TestReport) -> str:
    """The exception line of a failed phase (the last line of a longer representation otherwise)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message)
    text = str(report.longrepr).strip()
    return text.splitlines()[-1] if text else ""


class Recorder:
    def __init__(self, events: str, results: str) -> None:
        self.events, self.results = events, results
        self.offset = 0
        self.outcome: dict[str, Any] = {}

    @pytest.hookimpl
    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        self.offset = os.path.getsize(self.events) if os.path.exists(self.events) else 0
        self.outcome = {"outcome": "passed", "message": ""}

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed and self.outcome["outcome"] != "failed":
            self.outcome = {"outcome": "failed", "phase": report.when, "message": failure_message(report)}
        elif report.skipped and self.outcome["outcome"] == "passed":
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.outcome = {"outcome": "skipped", "message": str(reason)}

    @pytest.hookimpl
    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
        records, self.offset = read_from(self.events, self.offset)
        line = {"nodeid": nodeid, **self.outcome, "events": [[r["kind"], r["detail"]] for r in records]}
        with open(self.results, "a") as f:
            f.write(json.dumps(line) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(PRELOAD) == "1":
        # the ranks DeepSpeed's harness starts are forked from a forkserver; one that has imported deepspeed (and,
        # through the site hook, ds_tensorshard in the plugin run) spares each rank those imports
        multiprocessing.set_forkserver_preload(["__main__", "deepspeed"])
    if os.environ.get(EVENTS) and os.environ.get(RESULTS):
        config.pluginmanager.register(Recorder(os.environ[EVENTS], os.environ[RESULTS]), "ds_tensorshard_suite")
