"""One logging set-up (services.common.logs) for every process: one line format naming the
process's role, called by every entry point instead of its own ``logging.basicConfig``. The
services' real logs are checked against the format in tests/security/test_logs.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.logs import log_format

SERVICES = Path(__file__).resolve().parents[2] / "services"
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                  r"(\S+) (\S+): (.*)$")


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)


def test_one_format_with_the_role() -> None:
    proc = run("import logging\n"
               "from services.common.logs import setup_logging\n"
               "setup_logging('debug', 'engine-tp1')\n"
               "logging.getLogger('services.x').debug('n=%d', 3)\n"
               "logging.getLogger('services.y').info('100% done')\n")
    assert proc.returncode == 0, proc.stderr
    lines = [LINE.match(line) for line in proc.stderr.splitlines()]
    assert all(lines) and [m.groups() for m in lines] == [
        ("DEBUG", "engine-tp1", "services.x", "n=3"),
        ("INFO", "engine-tp1", "services.y", "100% done"),
    ]


@pytest.mark.parametrize("level", ["loud", ""])
def test_a_bad_level_is_refused(level: str) -> None:
    proc = run(f"from services.common.logs import setup_logging; setup_logging({level!r}, 'x')")
    assert proc.returncode == 1 and "log_level must be one of DEBUG" in proc.stderr


def test_a_role_cannot_break_the_format() -> None:
    with pytest.raises(ValueError, match="log role"):
        log_format("%(secret)s")


def test_no_entry_point_configures_logging_its_own_way() -> None:
    """``logging.basicConfig`` is called in services.common.logs only."""
    calls = [str(p.relative_to(SERVICES)) for p in sorted(SERVICES.rglob("*.py"))
             if "basicConfig(" in p.read_text()]
    assert calls == ["common/logs.py"]
