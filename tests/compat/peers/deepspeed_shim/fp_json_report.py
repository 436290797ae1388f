"""pytest plugin (loaded with ``-p fp_json_report``): ``--fp-json PATH`` writes a JSON summary of the run.

The summary has the outcome counts and one record per test (node id, outcome,
and the skip/failure reason), so a GPU run's results come back as one file.
"""

import json
import os


def pytest_addoption(parser):
    parser.addoption("--fp-json", default=None, help="write a JSON summary of the run to this path")


_records = []


def pytest_runtest_logreport(report):
    if (
        report.when == "call"
        or (report.when == "setup" and report.outcome != "passed")
        or (report.when == "teardown" and report.outcome == "failed")
    ):
        outcome = report.outcome
        reason = ""
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2])
        elif report.failed:
            reason = str(report.longrepr)[-2000:]
        _records.append(
            {
                "test": report.nodeid,
                "when": report.when,
                "outcome": outcome,
                "reason": reason,
            }
        )


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--fp-json")
    if not path:
        return
    counts = {}
    for r in _records:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(
            {"exitstatus": int(exitstatus), "counts": counts, "tests": _records},
            f,
            indent=1,
        )
