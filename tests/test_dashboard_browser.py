"""The dashboard (issue 17, docs/dashboard.md) in a real browser, against the real server under load.

Headless Chromium from the distribution's packages (``/usr/bin/chromium``; no browser is downloaded)
is driven with playwright's Python API. The server is a fresh engine with a tiny KV cache, so that
the background load (threads sending completions with httpx) preempts requests. The tests read the
page's state on ``window.dashboard`` and its elements, and write screenshots under each test's
``tmp_path`` (their paths are printed; ``pytest -s`` shows them).

The tests share one page, whose state accumulates, but each sets up what it needs (starting the load,
sending its chat), so that any selection of them passes in any order: the load starts in the first test
and stops in the KV-grid one; the request-life test sends a chat of its own.

The tests skip, saying what is missing and how to install it, when playwright or Chromium is not
there (``make test`` installs both where it can).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

#: The Chromium the tests drive: ``PAGEDSERVE_CHROMIUM``, else Debian's package, else one on the PATH.
CHROMIUM = os.environ.get("PAGEDSERVE_CHROMIUM") or (
    "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else shutil.which("chromium"))

try:
    from playwright.sync_api import Browser, Page, sync_playwright
    from playwright.sync_api import Error as PlaywrightError
except ImportError:
    pytest.skip("playwright is not installed: `pip install playwright` (it is in the test extra: "
                "`pip install -e '.[test]'`); no `playwright install` is needed, the tests drive the system "
                "Chromium", allow_module_level=True)
if CHROMIUM is None or not os.path.exists(CHROMIUM):
    pytest.skip(f"Chromium is not installed ({CHROMIUM or 'no /usr/bin/chromium, none on the PATH'}): "
                "`apt-get install chromium` (Debian; `make test` runs it as root), or set PAGEDSERVE_CHROMIUM "
                "to a Chromium binary", allow_module_level=True)

BLOCK_SIZE = 16
#: 15 usable blocks of 16 tokens: 240 tokens. Each load request holds ~6 blocks (a ~60-token prompt and
#: 32 output tokens), so four at once preempt one another.
NUM_BLOCKS = 16
LOAD_THREADS = 4
LOAD_MAX_TOKENS = 32
#: Milliseconds the page gets to show something: a deadline for a loaded machine, not an expected time.
WAIT_MS = 60_000


def _prompt(thread: int, count: int) -> str:
    """A prompt of ~60 tokens, different in its first block for each request (no prefix sharing)."""
    return (f"Request {thread}-{count}. " + "The scheduler plans every engine step: which requests run, "
            "how many tokens each gets, and which blocks of the paged cache hold their keys and values. " * 2)


class Load:
    """Background threads, each sending completions one after another until stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.threads: list[threading.Thread] = []
        self.stopping = threading.Event()
        self.completed = 0
        self.errors: list[str] = []

    @property
    def running(self) -> bool:
        return bool(self.threads)

    def start(self, num_threads: int = LOAD_THREADS) -> None:
        """Start the threads, unless they run already."""
        if self.threads:
            return
        self.stopping.clear()
        self.threads = [threading.Thread(target=self._send, args=(i,), name=f"dashboard-load-{i}", daemon=True)
                        for i in range(num_threads)]
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        """Stop the threads once their requests in flight have finished."""
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=120)
        self.threads = []

    def _send(self, index: int) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            count = 0
            while not self.stopping.is_set():
                body = {"prompt": _prompt(index, count), "max_tokens": LOAD_MAX_TOKENS, "temperature": 0,
                        "ignore_eos": True}
                try:
                    response = client.post("/v1/completions", json=body)
                except httpx.HTTPError as error:
                    self.errors.append(f"{type(error).__name__}: {error}")
                    continue
                if response.status_code == 200:
                    self.completed += 1
                else:
                    self.errors.append(f"{response.status_code}: {response.text[:200]}")
                count += 1


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        try:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        except PlaywrightError as error:
            pytest.skip(f"Chromium ({CHROMIUM}) does not start: {str(error).splitlines()[0]}; "
                        "`apt-get install chromium` installs it with its libraries")
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def dash_server(serve_fresh_engine):
    """A fresh engine with a tiny KV cache (preemptions under load)."""
    return serve_fresh_engine(max_model_len=512, num_gpu_blocks_override=NUM_BLOCKS, block_size=BLOCK_SIZE,
                              max_num_seqs=8, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def load(dash_server) -> Iterator[Load]:
    load = Load(dash_server.url)
    yield load
    load.stop()
    assert not load.errors, f"load requests failed: {load.errors[:5]}"


class PageErrors(list):
    """The page's uncaught exceptions and console errors."""


@pytest.fixture(scope="module")
def page_errors() -> PageErrors:
    return PageErrors()


@pytest.fixture(scope="module")
def page(browser: Browser, dash_server, page_errors: PageErrors) -> Iterator[Page]:
    """The dashboard, open for the whole module (its state accumulates across the tests)."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.on("pageerror", lambda error: page_errors.append(f"uncaught: {error}"))
    page.on("console", lambda message: page_errors.append(f"console.error: {message.text}")
            if message.type == "error" else None)
    response = page.goto(f"{dash_server.url}/dashboard")
    assert response is not None and response.ok, f"GET /dashboard: {response and response.status}"
    page.wait_for_function("() => window.dashboard !== undefined", timeout=WAIT_MS)
    yield page
    context.close()


@pytest.fixture(autouse=True)
def no_page_errors(request, page_errors: PageErrors) -> Iterator[None]:
    """Each test that uses the page fails when the page threw or logged an error meanwhile."""
    before = len(page_errors)
    yield
    if "page" in request.fixturenames:
        assert page_errors[before:] == [], "the page reported errors"


def screenshot(page: Page, tmp_path: Path, name: str) -> Path:
    """Save the page, as seen, under ``tmp_path`` and print where."""
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path


def state(page: Page, expression: str):
    """``window.dashboard``'s ``expression`` (e.g. ``"stepsSeen"``, ``"kv.states"``)."""
    return page.evaluate(f"() => window.dashboard.{expression}")


def wait_until(page: Page, js: str, arg=None, timeout_ms: int = WAIT_MS, what: str = "") -> None:
    """Poll ``js`` (a function of ``arg``) in the page every 100 ms until it is truthy."""
    try:
        page.wait_for_function(js, arg=arg, polling=100, timeout=timeout_ms)
    except PlaywrightError as error:
        raise AssertionError(f"timed out after {timeout_ms} ms waiting for {what or js}") from error


#: A fingerprint of a canvas's pixels (to tell whether it was redrawn differently) and how many of its
#: sampled pixels are painted (not transparent).
CANVAS_JS = """(id) => {
  const canvas = document.getElementById(id);
  const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
  let hash = 0, painted = 0;
  for (let i = 0; i < data.length; i += 4 * 7) {
    hash = (Math.imul(hash, 31) + data[i] + 3 * data[i + 1] + 7 * data[i + 2] + 11 * data[i + 3]) | 0;
    if (data[i + 3]) painted++;
  }
  return {hash, painted};
}"""


def canvas(page: Page, element_id: str) -> dict:
    return page.evaluate(CANVAS_JS, element_id)


def wait_for_redraw(page: Page, element_id: str, drawn: dict) -> dict:
    """Wait until canvas ``element_id`` differs from ``drawn`` (a ``canvas()`` result); return the new one."""
    wait_until(page, f"(hash) => ({CANVAS_JS})({element_id!r}).hash !== hash", drawn["hash"],
               what=f"#{element_id} to be redrawn differently")
    return canvas(page, element_id)


def show_tab(page: Page, name: str) -> None:
    page.click(f"#tab-{name}")
    assert page.is_visible(f"#panel-{name}")


#: The question the chat tests ask, and the reply's length in tokens.
CHAT_PROMPT, CHAT_MAX_TOKENS = "Name three colours.", 24


def send_chat(page: Page) -> str:
    """Ask ``CHAT_PROMPT`` greedily in the chat tab and wait for the whole reply; returns its text."""
    show_tab(page, "chat")
    page.fill("#chat-temperature", "0")
    page.fill("#chat-max-tokens", str(CHAT_MAX_TOKENS))
    page.fill("#chat-input", CHAT_PROMPT)
    replies = page.locator("#chat-log .assistant").count()
    page.click("#chat-send")
    wait_until(page, """(n) => { const r = document.querySelectorAll("#chat-log .assistant")[n];
                                 return r && !r.classList.contains("streaming") && r.textContent.trim(); }""",
               replies, what="a finished .assistant reply in #chat-log")
    return page.locator("#chat-log .assistant").nth(replies).inner_text()


#: The ids of the requests the page saw preempted and then finish, the latest first (so the first one is in
#: the page's list of recent requests).
PREEMPTED_AND_FINISHED_JS = ("Object.values(window.dashboard.requests)"
                             ".filter((life) => life.preemptedAt.length && life.finish)"
                             ".sort((a, b) => b.lastTime - a.lastTime).map((life) => life.id)")


def preempted_and_finished(page: Page, load: Load) -> list[str]:
    """What ``PREEMPTED_AND_FINISHED_JS`` lists, running the load (if it is not running) until it lists one."""
    started = not load.running
    load.start()
    wait_until(page, f"() => {PREEMPTED_AND_FINISHED_JS}.length", what="a load request preempted, then finished")
    if started:
        load.stop()
    return page.evaluate(f"() => {PREEMPTED_AND_FINISHED_JS}")


# ---------------------------------------------------------------- the engine tab, under load

def test_the_timeline_advances_under_load(page, load, tmp_path):
    """(a) With requests running, records keep coming (``stepsSeen``, ``lastStep``) and the timeline
    canvas is redrawn with them."""
    show_tab(page, "engine")
    load.start()
    seen = state(page, "stepsSeen")
    wait_until(page, "(n) => window.dashboard.stepsSeen >= n + 20 && window.dashboard.lastStep.requests.length",
               seen, what="20 more step records, the last with requests")
    step, drawn = state(page, "lastStep.step"), canvas(page, "timeline")
    wait_until(page, "(s) => window.dashboard.lastStep.step > s + 5", step, what="the last step to move on")
    redrawn = wait_for_redraw(page, "timeline", drawn)  # on the next animation frame
    assert redrawn["painted"] > 1000, f"#timeline: expected columns drawn, got {redrawn['painted']} painted pixels"
    last = state(page, "lastStep")
    assert last["max_num_batched_tokens"] == 256 and last["kv_blocks"]["total"] in (NUM_BLOCKS, NUM_BLOCKS - 1)
    screenshot(page, tmp_path, "timeline-under-load")


def test_a_preemption_shows_up_with_a_tiny_kv_cache(page, load, dash_server, tmp_path):
    """(c) Four requests of ~6 blocks each in 15 blocks: the engine preempts, and the page counts it
    and marks the request's life."""
    show_tab(page, "engine")
    load.start()
    wait_until(page, "() => window.dashboard.preemptions > 0", what="window.dashboard.preemptions > 0")
    assert dash_server.engine.get_stats().num_preemptions > 0
    preempted = page.evaluate("() => Object.values(window.dashboard.requests)"
                              ".filter((life) => life.preemptedAt.length).map((life) => life.id)")
    assert preempted, "window.dashboard.requests: expected a life with preemptedAt, got none"
    assert all(i.startswith("cmpl-") for i in preempted), preempted
    screenshot(page, tmp_path, "preemption")


def test_clicking_a_kv_block_shows_its_request(page, load, tmp_path):
    """(e) A click on a block in use in the KV grid shows the life of a request holding it."""
    show_tab(page, "engine")
    load.start()
    wait_until(page, "() => window.dashboard.kv && window.dashboard.kv.states.includes('U')",
               what="a KV snapshot with blocks in use")
    box = page.locator("#kv-grid").bounding_box()
    # The grid's layout: square cells, as many per row as fit (``kvLayout`` in dashboard.js); 16 blocks
    # make one row, so the canvas's height is the cell's size.
    cell = box["height"]
    cols = int(box["width"] // cell)
    deadline = time.monotonic() + WAIT_MS / 1000
    # The next snapshot (once a second) may free the block before the click: then click the next one in use.
    while not page.locator("#request-life h4").count():
        assert time.monotonic() < deadline, "#request-life: expected a request after a click on a block in use"
        wait_until(page, "() => window.dashboard.kv.states.includes('U')", what="a KV snapshot with blocks in use")
        block = page.evaluate("() => window.dashboard.kv.states.indexOf('U')")
        page.mouse.click(box["x"] + (block % cols + 0.5) * cell, box["y"] + (block // cols + 0.5) * cell)
    shown = page.inner_text("#request-life h4").strip()
    assert shown.startswith("cmpl-"), f"#request-life h4: expected a load request's id, got {shown!r}"
    assert "arrival" in page.inner_text("#request-life")
    screenshot(page, tmp_path, "kv-block-clicked")


def test_the_kv_grid_follows_requests_as_they_arrive_and_finish(page, load, dash_server, tmp_path):
    """(b) Under load the snapshot has blocks in use ('U') and changes from poll to poll; once the
    load is over it has none, and the grid is drawn differently."""
    show_tab(page, "engine")
    load.start()
    # The page keeps each different snapshot with blocks in use that it polls, until it has three.
    wait_until(page, """() => { const kv = window.dashboard.kv;
                                window.__kvInUse = window.__kvInUse || {};
                                if (kv && kv.states.includes("U")) window.__kvInUse[kv.states] = kv;
                                return Object.keys(window.__kvInUse).length >= 3; }""",
               what="3 different KV snapshots with blocks in use")
    for kv in page.evaluate("() => Object.values(window.__kvInUse)"):
        assert len(kv["states"]) == kv["num_blocks"] == NUM_BLOCKS and kv["states"][0] == "N"
        assert kv["block_size"] == BLOCK_SIZE and kv["owners"], kv
    loaded = canvas(page, "kv-grid")
    screenshot(page, tmp_path, "kv-under-load")
    load.stop()
    assert not load.errors, load.errors[:5]
    wait_until(page, "() => !window.dashboard.kv.states.includes('U') && "
               "!Object.keys(window.dashboard.kv.owners).length", what="a KV snapshot with no block in use")
    kv = state(page, "kv")
    assert set(kv["states"][1:]) <= {"C", "F"} and "C" in kv["states"], kv["states"]  # prefix caching keeps them
    wait_for_redraw(page, "kv-grid", loaded)  # once idle
    screenshot(page, tmp_path, "kv-idle")


def test_the_page_counts_every_preemption_once(page, load, dash_server):
    """After the load, the page's total (from a decimated stream and its back-fill) equals the
    engine's, and every load request's life ends with its finish."""
    load.stop()
    engine_total = dash_server.engine.get_stats().num_preemptions
    wait_until(page, "(n) => window.dashboard.preemptions === n", engine_total,
               what=f"window.dashboard.preemptions == the engine's {engine_total}")
    # The last finishes can reach the page after the preemption count does (the stream is rate-limited).
    wait_until(page, "() => Object.values(window.dashboard.requests).every((life) => life.finish)",
               what="every life in window.dashboard.requests to end with its finish")


# ---------------------------------------------------------------- the chat tab

def test_the_chat_streams_an_answer(page, dash_server, tmp_path):
    """(d) The chat sends a streamed request with the form's sampling fields and shows the reply as
    it comes: the greedy reply the API gives, appearing in more than one piece."""
    # Every length the streaming reply's text takes.
    page.evaluate("""() => {
      window.__replyLengths = [];
      new MutationObserver(() => {
        const reply = document.querySelector("#chat-log .assistant.streaming");
        if (reply) window.__replyLengths.push(reply.textContent.length);
      }).observe(document.getElementById("chat-log"), {childList: true, subtree: true, characterData: true});
    }""")
    text = send_chat(page)
    lengths = sorted(set(page.evaluate("() => window.__replyLengths")) - {0})
    assert len(lengths) >= 2, f".assistant: expected the text to grow while streaming, got lengths {lengths}"
    expected = httpx.post(f"{dash_server.url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": CHAT_PROMPT}], "temperature": 0, "max_tokens": CHAT_MAX_TOKENS,
    }).json()["choices"][0]["message"]["content"]
    assert text.strip() == expected.strip()
    assert page.locator("#chat-log .error").count() == 0
    assert page.inner_text("#chat-request-id").startswith("chatcmpl-")
    screenshot(page, tmp_path, "chat")


def test_the_chat_request_id_and_the_recent_list_show_request_lives(page, load, tmp_path):
    """(e) The chat's request id opens its life in the Engine tab; a preempted load request, clicked
    in the recent list, shows its steps, its preemptions and its finish."""
    send_chat(page)
    page.click("#chat-request-id a")
    assert page.is_visible("#panel-engine")
    chat_id = page.get_attribute("#chat-request-id a", "data-request")
    wait_until(page, "(id) => document.querySelector('#request-life h4').textContent.startsWith(id)", chat_id,
               what=f"#request-life to show {chat_id}")
    # The chat's reply can be complete before the step record holding its finish reaches the page (the step
    # stream sends at most a few records a second; seen under load): wait for the finish row.
    wait_until(page, "() => document.querySelectorAll('#request-life tr.finish').length === 1",
               what=f"#request-life to show {chat_id}'s finish")
    assert page.evaluate("(id) => window.dashboard.requests[id].finish.reason", chat_id) in ("length", "stop")
    screenshot(page, tmp_path, "chat-request-life")

    preempted = preempted_and_finished(page, load)
    item = page.locator(f"#recent-requests li[data-request='{preempted[0]}']")
    item.click()
    wait_until(page, "(id) => document.querySelector('#request-life h4').textContent.startsWith(id)",
               preempted[0], what=f"#request-life to show {preempted[0]}")
    life = page.inner_text("#request-life")
    assert page.locator("#request-life tr.preempt").count() >= 1, f"#request-life: no preemption row in {life!r}"
    finish = page.inner_text("#request-life tr.finish")
    assert "length" in finish and str(LOAD_MAX_TOKENS) in finish, f"#request-life tr.finish: got {finish!r}"
    assert page.locator("#request-life tbody tr").count() > LOAD_MAX_TOKENS // 2  # a row per step it ran in
    screenshot(page, tmp_path, "preempted-request-life")
