"""The console in a real browser: Debian's chromium, headless, driven by Playwright, against a
real ``saltserve serve`` on the bundled model. Walks the operator flow end to end (log in,
create a tenant, issue a key, chat through the OpenAI SDK, read usage and hit rate, rotate the
salt and see the next request miss, reset the cache, find every action in the audit log), with
the main flows driven by the keyboard alone, and checks the session and CSRF rules from the
browser's side. A PNG of every page is saved under ``$SALTSERVE_TEST_ARTIFACTS/console``
(default ``.cache/test-artifacts/console``).

Chromium comes from the project's set-up (``make install`` / ``.ci/run`` install Debian's
``chromium`` package); Playwright's own browser download is not used.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import httpx
import openai
import pytest
from serve_process import REPO_ROOT, free_port, serve

CHROMIUM = os.environ.get("SALTSERVE_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("SALTSERVE_TEST_ARTIFACTS", REPO_ROOT / ".cache" / "test-artifacts")
                 ) / "console"
MODEL = "SmolLM2-135M-Instruct"
# A prompt of several 16-token blocks, so that a repeat hits the prefix cache.
MESSAGES = [{"role": "system", "content": "You are a terse assistant for a logistics company. "
                                          "Answer in one short sentence. " * 3},
            {"role": "user", "content": "Which port is larger, Rotterdam or Hamburg?"}]


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory):
    with serve(model_dir, tmp_path_factory.mktemp("console-browser")) as proc:
        yield proc
    assert "Traceback" not in proc.output, proc.output[-3000:]


@pytest.fixture(scope="module")
def browser() -> Iterator:
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `make install` installs Debian's chromium "
                    "(apt-get install chromium), as .ci/run does")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM,
                              args=["--headless", "--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def admin_token(server, subject: str = "ops-alice") -> str:
    out = subprocess.run([sys.executable, "-m", "app.cli", "token", "issue", "--role", "admin",
                          "--ttl", "3600", "--subject", subject], cwd=REPO_ROOT,
                         env={**os.environ, "SALTSERVE_DATA_DIR": str(server.data_dir)},
                         capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


class Operator:
    """One browser page as an operator: keyboard helpers, screenshots, CSP watch."""

    def __init__(self, page, base: str) -> None:
        self.page, self.base = page, base
        self.problems: list[str] = []  # CSP violations and script errors
        page.on("console", lambda m: self.problems.append(m.text)
                if m.type == "error" else None)
        page.on("pageerror", lambda e: self.problems.append(str(e)))
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        for old in ARTIFACTS.glob("*.png"):  # only this run's pages
            old.unlink()

    def shot(self, name: str) -> None:
        self.page.screenshot(path=ARTIFACTS / f"{name}.png", full_page=True)

    def tab_to(self, selector: str, max_tabs: int = 80) -> None:
        """Presses Tab until ``selector`` has the focus (the keyboard alone reaches it)."""
        target = self.page.locator(selector)
        for _ in range(max_tabs):
            self.page.keyboard.press("Tab")
            if target.evaluate("el => el === document.activeElement"):
                return
        raise AssertionError(f"Tab never reached {selector}")

    def heading(self, text: str) -> None:
        from playwright.sync_api import expect

        expect(self.page.locator("h1")).to_have_text(text)


def test_operator_flow_in_a_real_browser(server, browser):
    from playwright.sync_api import expect

    base = server.base
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    op = Operator(context.new_page(), base)
    page = op.page

    # -- log in, by keyboard: a tenant key is refused first -----------------------------------
    page.goto(base + "/console")
    assert page.url == base + "/console/login"
    op.heading("Log in")
    op.shot("01-login")
    demo_key = (server.data_dir / "demo-api-key").read_text().strip()
    op.tab_to("#token")
    page.keyboard.insert_text(demo_key)
    op.tab_to("button[type=submit]")
    page.keyboard.press("Enter")
    expect(page.locator("#login-error")).to_contain_text("API key")
    op.shot("02-login-refused")
    op.tab_to("#token")
    page.keyboard.insert_text(admin_token(server))
    op.tab_to("button[type=submit]")
    page.keyboard.press("Enter")
    op.heading("Overview")
    assert "ops-alice" in page.locator(".who").inner_text()
    cookie = next(c for c in context.cookies() if c["name"] == "saltserve_console")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/console"
    assert "saltserve_console" not in page.evaluate("document.cookie")  # scripts cannot read it

    # -- create a tenant and issue a key, by keyboard ------------------------------------------
    op.tab_to("nav a[href='/console/tenants']")
    page.keyboard.press("Enter")
    op.heading("Tenants")
    op.tab_to("#new-name")
    page.keyboard.type("acme")
    op.tab_to("form.inline button[type=submit]")
    page.keyboard.press("Enter")
    op.heading("Tenant acme")
    expect(page.locator(".flash-ok")).to_contain_text("Tenant acme created")
    op.tab_to("#key-name")
    page.keyboard.type("acme-prod")
    op.tab_to("#keys-heading + form button[type=submit]")
    page.keyboard.press("Enter")
    dialog = page.locator("#new-key-dialog")
    expect(dialog).to_be_visible()
    key = page.locator("#new-key-value").input_value()
    assert key.startswith("ss-")
    op.shot("04-new-key-dialog")
    page.keyboard.press("Escape")  # closes the modal: the key leaves the page
    expect(dialog).to_have_count(0)
    assert key not in page.content()
    op.shot("03-tenant")

    # -- chat through the OpenAI SDK with the new key: the repeat hits ------------------------
    client = openai.OpenAI(base_url=base + "/v1", api_key=key)

    def chat() -> int:
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                           temperature=0)
        return r.usage.prompt_tokens_details.cached_tokens

    assert chat() == 0
    assert chat() > 0

    # -- usage and hit rate appear -------------------------------------------------------------
    page.goto(f"{base}/console/usage?tenant=acme&range=1h")
    op.heading("Usage")
    cells: list[str] = []
    for _ in range(40):  # usage rows are written by the journal within a second or so, and the
        # two requests' rows may land in different flushes: wait for both
        rows = page.locator("#usage-rows tbody tr")
        cells = rows.first.locator("td").all_inner_texts() if rows.count() else []
        if len(cells) > 6 and cells[1] == "2":
            break
        page.wait_for_timeout(500)
        page.reload()
    assert len(cells) > 6 and cells[1] == "2" and cells[4] != "0", cells  # 2 requests, cached
    assert cells[5] == "0"  # from the tiers: both hits were in the pool
    assert re.fullmatch(r"\d+\.\d%", cells[7]) and float(cells[7][:-1]) > 0  # hit rate
    page.wait_for_function("() => !!Chart.getChart(document.querySelector('[data-chart-id=chart-requests]'))",
                           timeout=5_000)
    op.shot("05-usage")
    csv = page.locator("a[download]").get_attribute("href")
    assert "tenant=" in csv and "range=1h" in csv

    page.goto(base + "/console/overview")
    with page.expect_response(lambda r: "/console/overview/live" in r.url, timeout=15_000) as live:
        pass
    assert live.value.status == 200
    acme_row = page.locator("#tenant-cache tbody tr", has_text="acme")
    expect(acme_row).to_have_count(1)
    assert float(acme_row.locator("td").nth(4).inner_text()[:-1]) > 0  # its hit rate
    # Redrawn from the refreshed fragment's data (htmx swaps it in, console.js draws).
    page.wait_for_function("() => !!Chart.getChart(document.querySelector('[data-chart-id=chart-hit-rate]'))",
                           timeout=5_000)
    op.shot("06-overview")

    # -- rotate the salt (confirm shows the blocks dropped); the next request misses ------------
    page.goto(base + "/console/tenants/acme")
    op.tab_to("a[href$='/rotate-salt']")  # by keyboard, confirm step included
    page.keyboard.press("Enter")
    op.heading("Rotate the salt of acme?")
    blocks = int(re.search(r"(\d+) cached blocks of acme", page.locator("main").inner_text())
                 .group(1))
    assert blocks > 0
    op.shot("07-rotate-confirm")
    op.tab_to("main button[type=submit]")
    page.keyboard.press("Enter")
    expect(page.locator(".flash-ok")).to_contain_text(
        f"Salt rotated to version 2: {blocks} cached blocks dropped")
    expect(page.locator("#salt-version")).to_have_text("2")
    assert chat() == 0  # miss under the new salt
    assert chat() > 0   # ... and the cache warms up again

    # -- reset the cache ------------------------------------------------------------------------
    page.reload()
    page.get_by_role("link", name="Reset cache…").click()
    op.heading("Reset the prefix cache of acme?")
    op.shot("08-reset-confirm")
    page.get_by_role("button", name="Reset cache").click()
    expect(page.locator(".flash-ok")).to_contain_text("Prefix cache reset:")
    assert int(re.search(r"reset: (\d+) cached", page.locator(".flash-ok").inner_text())
               .group(1)) > 0
    expect(page.locator("#tenant-resident")).to_have_text("0")
    assert chat() == 0

    # -- every action in the audit log ----------------------------------------------------------
    page.goto(base + "/console/audit")
    page.get_by_label("Tenant").fill("acme")
    page.get_by_role("button", name="Filter").click()
    expect(page.locator("#audit tbody tr").first).to_be_visible()
    actions = page.locator("#audit tbody th").all_inner_texts()
    assert {"tenant.create", "api_key.create", "tenant.rotate_salt", "cache.reset"} <= set(actions)
    actors = set(page.locator("#audit tbody td:nth-child(2)").all_inner_texts())
    assert actors == {"ops-alice"}
    op.shot("09-audit")
    page.goto(base + "/console/tenants")
    expect(page.locator("#tenants tbody tr")).to_have_count(2)  # demo and acme
    op.shot("10-tenants")
    page.goto(base + "/console/audit?action=console.login")
    assert "ops-alice" in page.locator("#audit tbody").inner_text()

    # -- CSRF and session rules, from the browser ------------------------------------------------
    status = page.evaluate("""() => fetch('/console/tenants', {method: 'POST',
        body: new URLSearchParams({name: 'no-csrf-token'})}).then(r => r.status)""")
    assert status == 403
    evil_port = free_port()
    target = f"{base}/console/tenants"

    class Evil(BaseHTTPRequestHandler):  # another site that posts to the console
        def do_GET(self) -> None:
            body = (f'<form id="f" method="post" action="{target}">'
                    '<input name="name" value="forged-by-evil"></form>'
                    '<script>document.getElementById("f").submit()</script>').encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    evil = HTTPServer(("127.0.0.1", evil_port), Evil)
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    try:
        attacker = context.new_page()
        with attacker.expect_navigation(url=re.compile(r".*/console/tenants$")):
            attacker.goto(f"http://localhost:{evil_port}/")
        # SameSite=Strict: the cross-site post arrived without the session (and without the
        # CSRF token), so it was refused.
        assert "session has ended" in attacker.content() or "CSRF" in attacker.content()
        attacker.close()
    finally:
        evil.shutdown()
    admin = {"Authorization": f"Bearer {admin_token(server, 'checker')}"}
    names = {t["name"] for t in httpx.get(base + "/admin/tenants", headers=admin).json()["data"]}
    assert "no-csrf-token" not in names and "forged-by-evil" not in names and "acme" in names

    # -- log out: the old session cookie is dead --------------------------------------------------
    old = cookie["value"]
    page.goto(base + "/console/overview")
    page.get_by_role("button", name="Log out").click()
    expect(page.locator("main")).to_contain_text("You are logged out")
    op.shot("11-logged-out")
    page.goto(base + "/console/tenants")
    assert page.url == base + "/console/login"
    replay = httpx.get(base + "/console/tenants", cookies={"saltserve_console": old},
                       follow_redirects=False)
    assert replay.status_code == 303
    # No CSP violation, script error or failed asset; the only refused loads are the two
    # refusals above (the tenant key at login, the fetch without a CSRF token).
    expected = "the server responded with a status of 403"
    assert [p for p in op.problems if expected not in p] == [], op.problems
    assert len(op.problems) == 2, op.problems
    context.close()
