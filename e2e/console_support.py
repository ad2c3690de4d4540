"""What the console's browser tests share: the console as a real process, its users, a browser.

- :func:`write_users` writes a ``console_users_file`` (TOML ``[[users]]``: ``name``,
  ``password`` = scrypt with a random salt, ``role``), as ``python -m apogee_console.passwd``
  does.
- :class:`ConsoleProcess` runs ``python -m apogee_console`` on a free local port against a
  cluster's nameservers, waits until ``/readyz`` answers 200, and stops it (SIGTERM, then
  SIGKILL) whatever happens; its log is kept for the test report.
- :data:`CHROMIUM` and :data:`CHROMIUM_ARGS`: Debian's chromium (``scripts/system_packages.sh``
  installs it; Playwright downloads no browser here), headless, with nothing that phones home.
- :func:`screenshot` saves a page under ``docs/img/console/`` only when
  ``APOGEE_CONSOLE_SCREENSHOTS=1``, so that test runs do not rewrite the documentation's images.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from apogee.testkit.ports import free_port
from apogee.testkit.waiting import wait_until
from apogee_console.core.access import Role, users_entry

if TYPE_CHECKING:
    from playwright.sync_api import Page

ROOT = Path(__file__).resolve().parent.parent
#: Where :func:`screenshot` saves its images.
SCREENSHOT_DIR = ROOT / "docs" / "img" / "console"
#: Set to 1 to (re)write the screenshots.
SCREENSHOT_ENV = "APOGEE_CONSOLE_SCREENSHOTS"

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
#: Seconds the console may take to start and to stop.
START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0


@dataclass(frozen=True)
class User:
    name: str
    password: str
    role: Role


def write_users(path: Path, users: list[User]) -> Path:
    """A ``console_users_file`` holding ``users`` (each with a random salt)."""
    entries = [users_entry(u.name, u.password, u.role) for u in users]
    path.write_text("\n".join(entries))
    path.chmod(0o600)
    return path


def http_status(url: str, timeout: float = 1.0) -> int | None:
    """The HTTP status of ``GET url`` (None when nothing answers)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            status: int = response.status
            return status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


class ConsoleProcess:
    """``python -m apogee_console`` on a free port; :meth:`close` always stops it."""

    def __init__(
        self, namesrv: str, folder: Path, users_file: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = folder / "console.log"
        full_env = {
            **os.environ,
            "APOGEE_CONSOLE_CONSOLE_USERS_FILE": str(users_file),
            "APOGEE_CONSOLE_METRICS_LISTEN": "",
            **(env or {}),
        }
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "apogee_console",
                    "--listen",
                    f"127.0.0.1:{self.port}",
                    "--namesrv",
                    namesrv,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=folder,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        def ready() -> bool:
            if http_status(f"{self.url}/readyz") == 200:
                return True
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the console exited with status {self.proc.returncode}:\n{self.log_tail()}"
                )
            return False

        wait_until(ready, START_TIMEOUT, "the console ready", every=0.1, detail=self.log_tail)

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()[-lines:]
        except OSError as exc:
            return f"(cannot read {self.log}: {exc})"
        return f"==> console (pid {self.proc.pid}) {self.log} <==\n" + "\n".join(text)

    def close(self) -> int | None:
        """Stop the console (SIGTERM, SIGKILL after :data:`STOP_TIMEOUT`); its exit status."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT)
        return self.proc.returncode


def screenshots_wanted() -> bool:
    return os.environ.get(SCREENSHOT_ENV) == "1"


def screenshot(page: Page, name: str) -> None:
    """``docs/img/console/<name>.png`` of the whole page, when :data:`SCREENSHOT_ENV` is 1."""
    if not screenshots_wanted():
        return
    SCREENSHOT_DIR.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOT_DIR / f"{name}.png"), full_page=True)
