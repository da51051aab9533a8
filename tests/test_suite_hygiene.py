"""The suite guards its own rules, by reading the test sources: speed belongs in benchmarks
(``pagedllm bench``, whose reports say whether each target is met), so no test asserts on a
measured duration or on a target being met, or fires events from a timer;
waits are on conditions with a deadline (``assert time.monotonic() < deadline`` is fine); and no
test hard-codes a local port or picks a free one to hand over (bind port 0 and read it back)."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
RULES = {
    "a measured duration compared": re.compile(
        r"assert\b.*\belapsed\b|\belapsed\w*\s*[<>]|(monotonic|perf_counter|time)\(\)\s*-\s*\w+\s*[<>]"),
    "a benchmark's speed target asserted met": re.compile(r"assert\b.*\[[\"']met[\"']\]"),
    "an event fired from a timer": re.compile(r"threading\.Timer\("),
    "a hard-coded local port": re.compile(r"(127\.0\.0\.1|localhost):\d"),
    "a free port picked and handed over": re.compile(r"def free_port\b"),
}


def violations(text: str) -> list[str]:
    return [f"{n}: {what}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
            for what, rule in RULES.items() if rule.search(line)]


def test_the_rules_catch_what_they_name() -> None:
    bad = ("    assert time.monotonic() - t0 < 30\n    assert elapsed < 20, elapsed\n"
           "    threading.Timer(0.3, os.kill, (pid, 9)).start()\n    url = 'http://127.0.0.1:9'\n"
           "def free_port() -> int:\n    assert all(t[\"met\"] for t in res[\"targets\"])\n")
    assert len(violations(bad)) == 6
    fine = ("    deadline = time.monotonic() + 10\n    assert time.monotonic() < deadline, 'stuck'\n"
            "    url = f'http://127.0.0.1:{port}'\n"
            "    assert [t[\"target\"] for t in res[\"targets\"]] == names\n")
    assert violations(fine) == []


def test_no_timing_assertions_timers_or_port_races_in_the_tests() -> None:
    found = [f"{path.relative_to(TESTS)}:{v}" for path in sorted(TESTS.rglob("*.py"))
             if path.name != Path(__file__).name for v in violations(path.read_text())]
    assert not found, "\n".join(found)
