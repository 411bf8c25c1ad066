"""The browser view of a job (issue 34): `nccl-pg run --ui` and `nccl-pg why --ui` (nccl_pg/cli/ui.py).

One test loads the page of a real 4-rank job under `nccl-pg run` (host backend) in a real browser, Debian's
chromium driven by Playwright: rank 2 stuck in its own code while the others wait in an all_reduce, rank 3 a
straggler. Its JSON is checked without the browser first: the verdict in `nccl-pg why`'s words, one inquiry per
refresh and none while no page asks. The other tests need no job of ranks: the token, a port in use, a job that
ends while the page is open.

Playwright's own browser download is not used (CI machines cannot reach it): it drives /usr/bin/chromium
(NCCL_PG_TEST_CHROMIUM: another), with the flags that keep Chromium off the network, in a fresh profile.
NCCL_PG_UI_SCREENSHOT=PATH keeps the page's screenshot there (docs/ui_stuck_job.png was made so).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from harness.procs import clean_env

from nccl_pg.cli import jobs, main, ui, ui_state
from nccl_pg.diagnostics import incidents
from nccl_pg.elastic.records import Records
from nccl_pg.store import TCPStore, TCPStoreServer

JOB = '''\
import os, pathlib, time
import numpy as np
import nccl_pg as dist


def ready():
    pathlib.Path(os.environ["TEST_DIR"], f"ready.{dist.get_rank()}").touch()


def eval_step():
    ready()
    time.sleep(3600)  # STUCK HERE


def train_step(step, pair):
    if dist.get_rank() == 3:
        time.sleep(0.03)  # a slow data loader: rank 3 is late at every step
    dist.all_reduce(np.ones(1024, np.float32))
    if pair is not None and step % 3 == 0:
        dist.all_reduce(np.ones(16, np.float32), group=pair)


dist.init_process_group("host", init_method="env://", timeout=600.0)
pair = dist.new_group([0, 1], group_desc="pair")
pair = pair if dist.get_rank() in (0, 1) else None
for step in range(12):
    train_step(step, pair)
if dist.get_rank() == 2:
    eval_step()
work = dist.all_reduce(np.ones(1024, np.float32), async_op=True)
ready()
work.wait()
'''
STUCK_LINE = next(i for i, line in enumerate(JOB.splitlines(), 1) if "STUCK HERE" in line)
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]


def get(url: str, headers: dict[str, str] | None = None, timeout: float = 30) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def state(url: str) -> dict[str, Any]:
    status, body = get(url)
    assert status == 200, body
    return json.loads(body)


class Launcher:
    """`nccl-pg run --nproc 4 --ui 0 --elastic train.py` in ``folder`` (--elastic: the page shows its membership
    record); its stderr read on a thread (the page's URL)."""

    def __init__(self, folder: Path) -> None:
        (folder / "train.py").write_text(JOB)
        self.dir = folder
        self.env = clean_env({"TEST_DIR": str(folder), "TMPDIR": str(folder),
                              "NCCL_PG_RUNTIME_DIR": str(folder / "run")})
        self.proc = subprocess.Popen([sys.executable, "-m", "nccl_pg.cli.main", "run", "--nproc", "4", "--ui", "0",
                                      "--elastic", "--autopsy-time", "0", "--grace-period", "2", "train.py"],
                                     cwd=folder, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def url(self, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines:
                if "the job's page: " in line:
                    return line.split("the job's page: ")[1].split()[0]
            assert self.proc.poll() is None, "".join(self.lines)
            time.sleep(0.02)
        raise AssertionError(f"no page announced: {''.join(self.lines)}")

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not all((self.dir / f"ready.{r}").exists() for r in range(4)):
            assert self.proc.poll() is None, "".join(self.lines)
            assert time.monotonic() < deadline, "ranks not ready"
            time.sleep(0.01)

    def store(self) -> TCPStore:
        job = jobs.read(next((self.dir / "run").glob("run-*.json")).as_posix())
        return TCPStore(job.host, job.port, secret=job.secret, timeout=10)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def chromium() -> str:
    path = os.environ.get("NCCL_PG_TEST_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not os.access(path, os.X_OK):
        pytest.skip("no chromium: `make install-test` installs Debian's (apt-get install chromium) where it runs as "
                    "root; elsewhere install it, or set NCCL_PG_TEST_CHROMIUM to a Chromium binary")
    return path


@pytest.mark.timeout(150)
def test_the_page_of_a_stuck_job_in_a_browser(tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright  # noqa: PLC0415 - only this test drives a browser

    executable = chromium()
    job = Launcher(tmp_path)
    try:
        url = job.url()
        base, token = url.split("/?token=")
        api = f"{base}/api/state?token={token}"
        job.wait_ready()
        store = job.store()
        try:
            before = incidents.newest(store)
            with ThreadPoolExecutor(3) as pool:  # three pages at once: one inquiry
                first = list(pool.map(state, [api] * 3))
            assert incidents.newest(store) == before + 1
            assert first[0] == first[1] == first[2]
            time.sleep(2 * ui_state.MIN_INTERVAL)  # no page asks: nobody asks the job
            assert incidents.newest(store) == before + 1
        finally:
            store.close()
        # The first look, right after the ranks issued the collective: younger than a hang, it is not one yet
        # (verdicts.stuck_after: 1 s for this job's step).
        if max(g["for_s"] or 0 for r in first[0]["ranks"] for g in r["groups"]) < 1.0:
            assert [v["kind"] for v in first[0]["verdicts"]] == ["slow"], first[0]["verdicts"]
        deadline = time.monotonic() + 30
        s = first[0]
        while not any(v["kind"] == "stuck_in_user_code" for v in s["verdicts"]):
            assert time.monotonic() < deadline, s["verdicts"]
            time.sleep(0.5)
            s = state(api)

        # The JSON, without a browser: the verdict in why's words, each rank's row.
        assert s["ended"] is None and s["world"] == 4 and s["answered"] == 4 and not s["ok"]
        why = subprocess.run([sys.executable, "-m", "nccl_pg.cli.main", "why", "--json"], cwd=tmp_path, env=job.env,
                             capture_output=True, text=True, timeout=60)
        assert why.returncode == 1, why.stderr
        assert [v["text"] for v in s["verdicts"]] == [v["text"] for v in json.loads(why.stdout)["verdicts"]]
        (verdict,) = s["verdicts"]
        assert verdict["ranks"] == [2] and verdict["where"].endswith(f"train.py:{STUCK_LINE} in eval_step")
        rows = {r["rank"]: r for r in s["ranks"]}
        assert sorted(rows) == [0, 1, 2, 3] and [r for r in rows if rows[r]["culprit"]] == [2]
        assert rows[2]["state"] == "in its own code" and rows[2]["stack"][-1][:3] == [
            str(tmp_path / "train.py"), STUCK_LINE, "eval_step"]
        for r in (0, 1, 3):
            world = next(g for g in rows[r]["groups"] if g["group"] == "0")
            assert (world["in"], world["last"], rows[r]["state"]) == ("all_reduce #13", "all_reduce #12",
                                                                       "in a collective")
            assert world["for_s"] > 0 and not rows[r]["stack"]
        assert next(g for g in rows[0]["groups"] if g["desc"] == "pair")["last"] == "all_reduce #4"
        assert rows[3]["straggler"]["straggler"] and rows[3]["straggler"]["score"] < 0.5
        assert not any(rows[r]["straggler"]["straggler"] for r in (0, 1, 2))
        timeline = s["timeline"]["ranks"]
        in_flight = {r: [e["name"] for e in timeline[str(r)] if e["end_ms"] is None] for r in range(4)}
        assert in_flight == {0: ["all_reduce #13"], 1: ["all_reduce #13"], 2: [], 3: ["all_reduce #13"]}
        assert all(len(timeline[str(r)]) >= 12 for r in range(4)), timeline
        assert s["membership"] == [{"uuid": 0, "members": [0, 1, 2, 3], "why": "start"}]  # (--elastic's record 0)

        # The page in a browser.
        with sync_playwright() as p:
            browser = p.chromium.launch_persistent_context(
                str(tmp_path / "profile"), executable_path=executable, headless=True, args=CHROMIUM_FLAGS,
                viewport={"width": 1280, "height": 900})
            try:
                page = browser.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                page.goto(f"{url}&every=1")
                page.wait_for_selector("#verdicts li.problem")
                assert page.inner_text("#verdicts li.problem") == verdict["text"]
                row = page.locator('#ranks tr[data-rank="2"]')
                assert "culprit" in (row.get_attribute("class") or "")
                assert f"train.py:{STUCK_LINE} in eval_step" in row.locator("td.where").inner_text()
                assert f"line {STUCK_LINE}, in eval_step" in page.inner_text("#stacks")
                assert page.locator("#timeline svg g.row").count() == 4
                assert page.locator("#timeline svg rect.bar").count() >= 4 * 12
                assert page.locator("#timeline svg rect.inflight").count() == 3
                assert page.locator('#timeline svg g.row[data-rank="2"] rect.inflight').count() == 0
                assert "nothing in flight" in (page.text_content('#timeline svg g.row[data-rank="2"]') or "")
                assert "straggler" in page.inner_text('#ranks tr[data-rank="3"]')
                assert page.inner_text("#membership tbody").split("\t") == ["0", "0, 1, 2, 3", "start"]
                page.screenshot(path=os.environ.get("NCCL_PG_UI_SCREENSHOT") or str(tmp_path / "page.png"),
                                full_page=True)
                assert errors == []
                # The job ends while the page is open: the page says so at its next refresh.
                assert job.stop() != 0
                page.wait_for_selector("#ended:not([hidden])", timeout=15000)
                assert "the job has ended" in page.inner_text("#ended").lower()
            finally:
                browser.close()
    finally:
        job.stop()


@pytest.fixture
def lone_store(monkeypatch: pytest.MonkeyPatch) -> Iterator[TCPStoreServer]:
    """A store with no rank behind it (the page still serves, and says what it finds)."""
    monkeypatch.setenv("NCCL_PG_STORE_SECRET", "s3cret")
    server = TCPStoreServer("127.0.0.1", 0, secret="s3cret")
    server.start()
    yield server
    server.stop()


@pytest.mark.timeout(60)
def test_why_ui_token_port_in_use_and_a_job_that_ends(tmp_path: Path, lone_store: TCPStoreServer) -> None:
    """`nccl-pg why --ui` on a job's store: a wrong or missing token gets 403 (the page's own two static files, which
    hold nothing of the job, do not need it); the store going away while the page is open is said; a port in use is
    a clear error; SIGINT stops it."""
    store = f"127.0.0.1:{lone_store.port}"
    proc = subprocess.Popen([sys.executable, "-m", "nccl_pg.cli.main", "why", "--store", store, "--timeout", "0.3",
                             "--world-size", "2", "--ui", "127.0.0.1:0"], cwd=tmp_path, env=clean_env(
                                 {"NCCL_PG_STORE_SECRET": "s3cret", "TMPDIR": str(tmp_path)}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline(), proc.stdout.readline()]
        assert lines[0].strip() == f"nccl-pg why: store {store}", lines
        url = lines[1].split("the job's page: ")[1].split()[0]
        base, token = url.split("/?token=")
        assert base.startswith("http://127.0.0.1:")
        for bad in ("/", "/?token=", f"/?token={token}x", f"/api/state?token={token[:-1]}", "/api/state"):
            status, body = get(base + bad)
            assert status == 403 and b"token" in body, (bad, status)
        assert get(f"{base}/api/state", {"Authorization": "Bearer wrong"})[0] == 403
        assert get(f"{base}/api/state", {"Authorization": f"Bearer {token}"})[0] == 200
        assert get(f"{base}/nothing?token={token}")[0] == 404
        page, script = get(url), get(f"{base}/ui.js")
        assert page[0] == 200 and b'<script src="/ui.js"' in page[1] and script[0] == 200
        s = state(f"{base}/api/state?token={token}")
        assert s["ended"] is None and s["world"] == 2 and s["answered"] == 0 and s["membership"] is None
        assert [v["kind"] for v in s["verdicts"]] == ["no_answer", "no_answer"]

        # an elastic job's membership records, as its launcher writes them when a rank dies
        client = TCPStore("127.0.0.1", lone_store.port, secret="s3cret", timeout=10)
        try:
            records = Records(client)
            records.start([0, 1])
            records.write_next(lambda c: [0], "died: member 1 was killed by signal SIGKILL (its launcher saw it)")
        finally:
            client.close()
        time.sleep(ui_state.MIN_INTERVAL)
        assert state(f"{base}/api/state?token={token}")["membership"] == [
            {"uuid": 0, "members": [0, 1], "why": "start"},
            {"uuid": 1, "members": [0], "why": "died: member 1 was killed by signal SIGKILL (its launcher saw it)"}]

        # a port in use: the same words from both commands
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        try:
            (tmp_path / "never.py").write_text("open('started', 'w')")
            out = subprocess.run([sys.executable, "-m", "nccl_pg.cli.main", "run", "--ui", str(port), "never.py"],
                                 cwd=tmp_path, capture_output=True, text=True, timeout=60,
                                 env=clean_env({"TMPDIR": str(tmp_path), "NCCL_PG_RUNTIME_DIR": str(tmp_path / "run")}))
            assert out.returncode == 1, out
            assert f"nccl-pg run: --ui: cannot serve the page at 127.0.0.1:{port}: Address already in use (another " \
                   "process listens there: choose another port, or 0 for a free one)" in out.stderr
            assert not (tmp_path / "started").exists(), "a rank started although the page could not be served"
            assert main.main(["why", "--store", store, "--ui", f"127.0.0.1:{port}"]) == ui.EXIT_CANNOT_SERVE
        finally:
            taken.close()

        lone_store.stop()  # the job ends while the page is open
        time.sleep(ui_state.MIN_INTERVAL)
        s = state(f"{base}/api/state?token={token}")
        assert s["ended"].startswith(f"the job has ended, or its store at {store} cannot be reached"), s["ended"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_ui_address_argument() -> None:
    assert ui.address_arg("8080") == ("127.0.0.1", 8080)
    assert ui.address_arg("0.0.0.0:0") == ("0.0.0.0", 0)
    assert ui.address_arg("[::1]:9000") == ("::1", 9000)
    for bad in ("", "http", ":80", "host:", "host:70000", "-1"):
        with pytest.raises(Exception, match=r"expected \[HOST:\]PORT"):
            ui.address_arg(bad)
