"""A pytest plugin (`-p mutation_report`) that writes what the switch-off audit counts to the JSON file named by
COLOZOO_MUTATION_REPORT: the test ids collected, and each test's outcome ("passed", "failed": its test body
failed, "error": its setup or teardown failed, "skipped") with its seconds (setup + call + teardown)."""
from __future__ import annotations

import json
import os

REPORT = "COLOZOO_MUTATION_REPORT"
_found = {"collected": [], "outcomes": {}}


def pytest_collection_finish(session):
    _found["collected"] = [item.nodeid for item in session.items]


def pytest_runtest_logreport(report):
    entry = _found["outcomes"].setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0})
    entry["seconds"] = round(entry["seconds"] + report.duration, 2)
    if report.failed and (report.when == "call" or entry["outcome"] != "failed"):
        entry["outcome"] = "failed" if report.when == "call" else "error"
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(REPORT)
    if path:
        with open(path, "w") as f:
            json.dump(_found, f)
