"""The status page in a real headless browser (Debian's ``chromium``), against a live stack.

The browser loads ``/dashboard``, runs its script (which fetches ``/dashboard/state``) and the
DOM it built is read back (``--dump-dom``): the worker tables list every live worker, healthy;
after a language worker is killed, the page shows that worker as no longer healthy while the
others stay healthy. A screenshot of the page is a real image of the browser's size.
"""

from __future__ import annotations

import shutil
import signal
import struct
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

from tests.http.conftest import ARCH, start_http_stack, wait_for

BROWSER = "chromium"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run")  # fmt: skip


class Page(HTMLParser):
    """The worker rows and pool summaries of a dumped page."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.rows: dict[str, dict[str, str]] = {}
        self.texts: dict[str, str] = {}
        self.body: dict[str, str] = {}
        self._in: str | None = None
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        attrs = {k: v or "" for k, v in attrs}
        if tag == "tr" and "worker" in attrs.get("class", "").split():
            self.rows[attrs["data-id"]] = attrs
        elif tag == "body":
            self.body = attrs
        elif attrs.get("id", "").startswith("pool-"):
            self._in = attrs["id"]

    def handle_data(self, data: str) -> None:
        if self._in is not None:
            self.texts[self._in] = data.strip()
            self._in = None


def browse(url: str, tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    assert shutil.which(BROWSER), f"{BROWSER} is missing: `make apt` installs it"
    command = [BROWSER, *FLAGS, f"--user-data-dir={tmp / 'profile'}",
               "--virtual-time-budget=4000", *extra, url]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def load(url: str, tmp: Path) -> Page:
    page = Page(browse(url, tmp, "--dump-dom").stdout)
    assert page.body.get("data-updated"), "the page's script never rendered the state"
    return page


@pytest.fixture
def stack(tiny_model_dir, tmp_path):
    args = ("--dashboard-show-addresses", "--dashboard-sample-s", "0.5")
    stack = start_http_stack(tiny_model_dir(ARCH), tmp_path, num_languages=2, gateway_args=args)
    yield stack
    stack.stop()


def test_page_lists_every_worker_and_a_killed_one_turns_unhealthy(stack, tmp_path) -> None:
    url = stack.http_url + "/dashboard"
    workers = {p.address: role for role, procs in (("encoder", stack.encoders),
               ("language", stack.languages)) for p in procs}  # fmt: skip
    page = load(url, tmp_path)
    assert {a: r["data-role"] for a, r in page.rows.items()} == workers
    assert {r["data-state"] for r in page.rows.values()} == {"healthy"}
    assert page.texts == {"pool-encoder": "1 of 1 healthy", "pool-language": "2 of 2 healthy"}

    victim = stack.languages[1]
    victim.kill(signal.SIGKILL)
    state_url = stack.http_url + "/dashboard/state"

    def seen_unhealthy() -> bool:
        rows = {w["id"]: w["state"] for w in httpx.get(state_url).json()["workers"]}
        return rows.get(victim.address) in ("unhealthy", "gone")

    wait_for(seen_unhealthy, 30, "the gateway to notice the dead worker")
    page = load(url, tmp_path)
    assert page.rows[victim.address]["data-state"] in ("unhealthy", "gone")
    alive = {a for a in workers if a != victim.address}
    assert {page.rows[a]["data-state"] for a in alive} == {"healthy"}
    assert page.texts["pool-language"].startswith("1 of ")

    shot = tmp_path / "dashboard.png"
    browse(url, tmp_path, "--window-size=1280,860", "--hide-scrollbars", f"--screenshot={shot}")
    header = shot.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", header[16:24]) == (1280, 860)
