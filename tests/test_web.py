"""The chat page at ``/``, driven in Debian's headless Chromium by Playwright, on a real server.

The server runs the tiny fixture models. Requests whose last message contains ``[script]`` or
``[slow]`` are answered by a scripted generator (reasoning, Markdown, a tool call; or a long
slow answer to stop), everything else by the real DFlash loop, so the stats are real.
Screenshots (desktop and narrow) are written to a temp folder; their paths are printed.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_fixtures import (
    RunningServer,
    ScriptedGenerate,
    make_app,
    real_generate,
    run_server,
)

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = [
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="needs Debian's chromium at /usr/bin/chromium (.ci/run installs it)",
    ),
    pytest.mark.slow,  # a browser process per module: the slow tier (docs/development.md)
]
sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (the test extra)")

ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
KEY = "web-test-key"
ORIGIN = "http://ui.example"
SCRIPT = [
    "Let me think",
    " about *this*.",
    "</think>",
    '\n\nHere is **bold**, `code` and <img src=x onerror="window.__xss=1">.\n\n',
    "```python\nprint('hi')\n```\n\n",
    "- one\n- two\n",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "</function>\n</tool_call>",
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


class Generate:
    """Scripted answers for ``[script]``/``[slow]`` prompts, the real DFlash loop otherwise."""

    def __init__(self) -> None:
        self.script = ScriptedGenerate(SCRIPT, delay=0.25)
        self.slow = ScriptedGenerate(["word "] * 300, delay=0.05, source="target")

    def __call__(self, models: Any, request: Any) -> Any:
        prompt = models.pair.tokenizer.decode(list(request.prompt))
        last_user = prompt.rsplit("<|im_start|>user", 1)[-1]
        if "[script]" in last_user:
            return self.script(models, request)
        if "[slow]" in last_user:
            return self.slow(models, request)
        return real_generate(models, request)


@pytest.fixture(scope="module")
def generate() -> Generate:
    return Generate()


@pytest.fixture(scope="module")
def server(tiny_hybrid_path: Path, draft_path: Path, generate: Generate) -> Iterator[RunningServer]:
    app = make_app(
        tiny_hybrid_path,
        draft_path,
        generate=generate,
        served_model_name="tiny",
        api_key=KEY,
        allowed_origins=ORIGIN,
        context_length=512,
    )
    with run_server(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    # scripts/test.sh preloads OpenBLAS for MLX; Playwright's node driver cannot start with it
    # (pthread_create fails), so its process (and Chromium, started by it) runs without.
    preload = os.environ.pop("LD_PRELOAD", None)
    try:
        manager = sync_api.sync_playwright()
        pw = manager.__enter__()
    finally:
        if preload is not None:
            os.environ["LD_PRELOAD"] = preload
    try:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield b
        b.close()
    finally:
        manager.__exit__(None, None, None)


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("screenshots")


class Page:
    """A fresh browser context (empty localStorage) with its console errors collected."""

    def __init__(self, browser: Any, base: str, width: int = 1280, height: int = 800) -> None:
        self.context = browser.new_context(viewport={"width": width, "height": height})
        self.context.set_default_timeout(20_000)
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        self.page.goto(base + "/")
        self.ready()

    def ready(self) -> None:
        """Wait until the page has heard from /health."""
        self.page.wait_for_function(
            "() => document.getElementById('server-status').textContent.includes('ready')"
        )

    def configure(self, key: str = KEY, *, thinking: bool = False, max_tokens: str = "24") -> None:
        p = self.page
        if not p.is_visible("#api-key"):
            p.click("#settings summary")
        p.fill("#api-key", key)
        p.fill("#temperature", "0")
        p.fill("#max-tokens", max_tokens)
        p.select_option("#thinking", "on" if thinking else "off")

    def send(self, text: str) -> Any:
        self.page.fill("#prompt", text)
        self.page.press("#prompt", "Enter")
        return self.page.locator("article.msg.assistant").last

    def wait_done(self, timeout: float = 30_000) -> None:
        self.page.wait_for_selector("article.msg.assistant[aria-busy='false']", timeout=timeout)
        self.page.wait_for_function("() => !document.getElementById('send').disabled")

    def close(self) -> None:
        self.context.close()


def _stats(answer: Any) -> dict[str, str]:
    """An answer's stats line, label -> value."""
    items = answer.locator(".stats dl div").all()
    return {i.locator("dt").inner_text(): i.locator("dd").inner_text() for i in items}


def test_page_loads_without_key_and_streams_with_stats(browser: Any, server: RunningServer) -> None:
    page = Page(browser, server.base_url)
    p = page.page
    assert p.title() == "dflash-server chat"
    assert "tiny" in p.inner_text("#server-status")
    page.configure()
    answer = page.send("hello there")
    p.wait_for_function(
        "() => document.querySelector('article.msg.assistant .content').textContent.length > 0"
    )
    page.wait_done()
    assert answer.locator(".content").inner_text().strip()
    stats = answer.locator(".stats").inner_text()
    for label in ("tokens", "tok/s", "TTFT", "τ", "block"):
        assert label in stats, stats
    assert answer.locator(".hist .bar").count() == 8  # one bar per block position
    # The dflash_tokens extension: every token tinted by its source, together the raw answer.
    tokens = answer.locator(".tokens .tok")
    assert tokens.count() > 0
    sources = {tokens.nth(i).get_attribute("title") for i in range(tokens.count())}
    assert sources <= {"draft", "target"} and "target" in sources
    assert page.errors == []
    # The conversation survives a reload; New chat clears it.
    p.reload()
    assert p.locator("article.msg").count() == 2
    p.click("#new-chat")
    assert p.locator("article.msg").count() == 0
    assert json.loads(p.evaluate("() => localStorage.getItem('dflash.conversation')")) == []
    assert p.evaluate("() => localStorage.getItem('dflash.apiKey')") == KEY
    page.close()


def test_reasoning_markdown_and_tool_calls(
    browser: Any, server: RunningServer, shots: Path
) -> None:
    page = Page(browser, server.base_url)
    p = page.page
    page.configure(thinking=True)
    p.fill("#tools", json.dumps(TOOLS))
    answer = page.send("[script] what is the weather in Paris?")
    # Open while thinking, collapsed once the answer arrives.
    answer.locator("details.reasoning[open]").wait_for()
    page.wait_done()
    reasoning = answer.locator("details.reasoning")
    assert not reasoning.evaluate("d => d.open")
    assert answer.locator(".content strong").inner_text() == "bold"
    assert "print('hi')" in answer.locator(".content pre code").inner_text()
    assert answer.locator(".content li").count() == 2
    assert answer.locator(".content img").count() == 0
    assert "<img" in answer.locator(".content").inner_text()  # shown as text, never markup
    assert p.evaluate("() => window.__xss") is None
    call = answer.locator(".tool-call").inner_text()
    assert "get_weather" in call and "Paris" in call
    # The reasoning opens from the keyboard.
    reasoning.locator("summary").focus()
    p.keyboard.press("Enter")
    assert reasoning.evaluate("d => d.open")
    assert "think about this" in reasoning.inner_text()
    assert page.errors == []

    # One real answer below it for the stats, then the screenshots.
    page.configure(thinking=False)
    p.fill("#tools", "")
    page.send("Tell me something")
    p.wait_for_function("() => document.querySelectorAll('article.msg.assistant').length === 2")
    page.wait_done()
    desktop = shots / "chat-desktop.png"
    p.screenshot(path=str(desktop), full_page=True)
    p.set_viewport_size({"width": 390, "height": 844})
    p.reload()  # the conversation is kept; on a narrow window the settings start folded
    answer.locator(".stats").wait_for()
    assert not p.is_visible("#api-key")
    narrow = shots / "chat-narrow.png"
    p.screenshot(path=str(narrow), full_page=True)
    assert p.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth")
    print(f"\nscreenshots: {desktop} {narrow}")
    page.close()


def test_stop_cancels_the_request_on_the_server(
    browser: Any, server: RunningServer, generate: Generate
) -> None:
    page = Page(browser, server.base_url)
    p = page.page
    page.configure(max_tokens="")
    answer = page.send("[slow] talk for a long time")
    p.wait_for_function(
        "() => document.querySelector('article.msg.assistant .content').textContent.includes('word')"
    )
    assert p.is_enabled("#stop") and not p.is_enabled("#send")
    p.click("#stop")
    answer.locator(".notice").wait_for()
    assert answer.locator(".notice").inner_text() == "Stopped."
    assert p.is_enabled("#send") and not p.is_enabled("#stop")
    deadline = time.monotonic() + 10
    while generate.slow.closed_early < 1:  # the server stopped generating
        assert time.monotonic() < deadline, "generation went on after Stop"
        time.sleep(0.05)
    words = answer.locator(".content").inner_text().count("word")
    assert words < 300
    # What was measured before Stop: the tokens that came, their rate, the time it ran.
    stats = _stats(answer)
    assert stats["tokens"] == str(words), stats
    assert float(stats["tok/s"]) > 0 and stats["elapsed"].endswith(" s") and "TTFT" in stats
    assert page.errors == []
    page.close()


def test_answer_shows_once_with_a_token_legend(browser: Any, server: RunningServer) -> None:
    """The tokens tinted by source are the answer again: folded, under their legend."""
    page = Page(browser, server.base_url)
    p = page.page
    page.configure(thinking=False)
    answer = page.send("say something")
    page.wait_done()
    assert answer.locator(".content").inner_text().strip()
    tokens = answer.locator("details.tokens")
    assert not tokens.evaluate("d => d.open") and not answer.locator(".tok-text").is_visible()
    legend = tokens.locator(".key").all()  # "swatch draft" -> "accepted draft: 7"
    counts = {k.locator(".swatch").get_attribute("class")[7:]: k.inner_text() for k in legend}
    assert "target" in counts and set(counts) <= {"draft", "suffix", "target"}, counts
    total = sum(int(text.rsplit(":", 1)[1]) for text in counts.values())
    assert total == answer.locator(".tok").count() and _stats(answer)["tokens"] == str(total)
    # Opened, the tinted tokens show, and stay open while the conversation re-renders.
    tokens.locator("summary").click()
    assert answer.locator(".tok-text").is_visible()
    page.send("more")
    page.wait_done()
    p.wait_for_function("() => document.querySelectorAll('article.msg.assistant').length === 2")
    assert p.locator("article.msg.assistant").first.locator(".tok-text").is_visible()
    assert page.errors == []
    page.close()


@pytest.fixture(scope="module")
def defaults_server(tiny_hybrid_path: Path, draft_path: Path) -> Iterator[RunningServer]:
    """A server started with temperature 0 and thinking off, and no API key."""
    app = make_app(
        tiny_hybrid_path,
        draft_path,
        generate=ScriptedGenerate(["Hi."]),
        served_model_name="tiny",
        temperature=0.0,
        enable_thinking=False,
    )
    with run_server(app) as srv:
        yield srv


def test_page_shows_server_defaults_and_sends_only_what_the_user_set(
    browser: Any, defaults_server: RunningServer
) -> None:
    page = Page(browser, defaults_server.base_url)
    p = page.page
    sent: list[dict[str, Any]] = []
    p.on("request", lambda r: sent.append(json.loads(r.post_data)) if r.method == "POST" else None)
    assert p.locator("#thinking option").first.inner_text() == "server default (off)"
    assert p.get_attribute("#temperature", "placeholder") == "server default: 0"
    assert p.get_attribute("#block-size", "placeholder") == "server default: auto"
    assert p.get_attribute("#max-tokens", "placeholder") == "server default: no limit"

    def ask(text: str) -> dict[str, Any]:
        page.send(text)
        page.wait_done()
        return sent[-1]

    untouched = ask("hello")
    assert not {"temperature", "chat_template_kwargs", "max_tokens"} & set(untouched), untouched
    p.fill("#temperature", "0.5")
    p.select_option("#thinking", "on")
    chosen = ask("again")
    assert chosen["temperature"] == 0.5 and chosen["chat_template_kwargs"]["enable_thinking"]
    # Choices survive a reload; emptied again, the field is the server's once more.
    p.reload()
    page.ready()
    assert p.input_value("#temperature") == "0.5" and p.input_value("#thinking") == "on"
    p.fill("#temperature", "")
    p.select_option("#thinking", "")
    assert "temperature" not in ask("last") and "chat_template_kwargs" not in sent[-1]
    assert page.errors == []
    page.close()


def test_stats_view_cached_tokens_and_token_tints(browser: Any, server: RunningServer) -> None:
    """The stats view: cached prompt tokens and tokens tinted by source, escaped."""
    page = Page(browser, server.base_url)
    html = page.page.evaluate(
        """async () => (await import('/web/views.js')).assistantHtml({
            role: 'assistant', content: 'hi', reasoning: '', toolCalls: [],
            usage: {completion_tokens: 3, prompt_tokens_details: {cached_tokens: 42}},
            dflash: {tau: 2.5, block_size: 4, acceptance_histogram: [1, 0, 2, 0]},
            tokens: [{text: 'h', source: 'draft'}, {text: '<i>', source: 'target'}],
        })"""
    )
    assert "<dt>cached prompt</dt><dd>42</dd>" in html
    assert '<span class="tok draft" title="draft">h</span>' in html
    assert '<span class="tok target" title="target">&lt;i&gt;</span>' in html
    assert html.count('class="bar"') == 4
    page.close()


@pytest.mark.parametrize("key", ["wrong-key", ""])
def test_bad_api_key_shows_a_readable_error(browser: Any, server: RunningServer, key: str) -> None:
    page = Page(browser, server.base_url, width=390, height=844)  # narrow: settings start closed
    p = page.page
    assert not p.is_visible("#api-key")
    page.configure(key=key)
    p.click("#settings summary")  # closed again: the error must reopen it
    assert not p.is_visible("#api-key")
    answer = page.send("hello")
    error = answer.locator(".error")
    error.wait_for()
    text = error.inner_text()
    assert "Error 401" in text and "API key" in text and "Settings" in text, text
    assert error.get_attribute("role") == "alert"
    assert p.is_visible("#api-key")  # settings opened to fix it
    # Chromium logs the failed request itself; the page's own code raised nothing.
    assert not [e for e in page.errors if "401" not in e], page.errors
    page.close()


def test_page_needs_no_key_and_has_cors_and_csp(server: RunningServer) -> None:
    r = httpx.get(f"{server.base_url}/", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "script-src 'self'" in r.headers["content-security-policy"]
    for name in ("app.js", "views.js", "markdown.js", "style.css"):
        assert httpx.get(f"{server.base_url}/web/{name}").status_code == 200
    assert httpx.get(f"{server.base_url}/web/secret.txt").status_code == 404
    assert httpx.get(f"{server.base_url}/v1/models").status_code == 401


def test_no_web_turns_the_page_off(tiny_hybrid_path: Path, tmp_path: Path) -> None:
    from starlette.testclient import TestClient

    # Not used as a context manager: no lifespan, so the engine never starts.
    on = TestClient(make_app(tiny_hybrid_path, tmp_path))
    off = TestClient(make_app(tiny_hybrid_path, tmp_path, web=False))
    for path in ("/", "/web/app.js"):
        assert on.get(path).status_code == 200
        assert off.get(path).status_code == 404
    assert off.get("/v1/models").status_code == 200  # the API is still there


# ----- images ----------------------------------------------------------------------------------

QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def vl_server(tiny_vl_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from server_fixtures import build_draft

    draft = build_draft(tmp_path_factory.mktemp("vl-draft") / "d", tiny_vl_path, block_size=4)
    with run_server(make_app(tiny_vl_path, draft, served_model_name="tiny-vl")) as srv:
        yield srv


def png(seed: int, size: tuple[int, int]) -> bytes:
    import io

    from test_images import picture

    buffer = io.BytesIO()
    picture(seed, size).save(buffer, format="PNG")
    return buffer.getvalue()


# A paste into the message box and a drop on the conversation, as the browser delivers them.
DELIVER = """async ([kind, b64, name]) => {
    const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
    const transfer = new DataTransfer();
    transfer.items.add(new File([bytes], name, { type: "image/png" }));
    const init = { bubbles: true, cancelable: true };
    const event = kind === "paste"
        ? new ClipboardEvent("paste", { ...init, clipboardData: transfer })
        : new DragEvent("drop", { ...init, dataTransfer: transfer });
    document.getElementById(kind === "paste" ? "prompt" : "messages").dispatchEvent(event);
}"""


def test_images_pasted_and_dropped_show_as_thumbnails(
    browser: Any, vl_server: RunningServer, shots: Path
) -> None:
    """Paste one image and drop another; a third chosen with the button is removed again.
    The message shows both as thumbnails (kept across a reload), and the answer is the API's
    answer for the same images and question."""
    import base64

    page = Page(browser, vl_server.base_url)
    p = page.page
    page.configure(key="")
    p.wait_for_function("() => !document.getElementById('attach').disabled")
    images = [png(1, (96, 64)), png(2, (64, 128))]
    p.evaluate(DELIVER, ["paste", base64.b64encode(images[0]).decode(), "a.png"])
    p.evaluate(DELIVER, ["drop", base64.b64encode(images[1]).decode(), "b.png"])
    p.wait_for_function("() => document.querySelectorAll('#attachments .thumb').length === 2")
    p.set_input_files("#image-input", files=[
        {"name": "c.png", "mimeType": "image/png", "buffer": png(3, (64, 64))}
    ])  # fmt: skip
    p.wait_for_function("() => document.querySelectorAll('#attachments .thumb').length === 3")
    p.click("#attachments button[aria-label='Remove image 3']")
    assert p.locator("#attachments .thumb").count() == 2
    answer = page.send(QUESTION)
    page.wait_done()
    question = p.locator("article.msg.user").last
    assert question.locator("img.thumb").count() == 2
    assert question.locator("img.thumb").first.get_attribute("alt") == "Image 1 you sent"
    assert p.locator("#attachments .thumb").count() == 0 and page.errors == []
    urls = [f"data:image/png;base64,{base64.b64encode(b).decode()}" for b in images]
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    body = {
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}],
        "temperature": 0,
        "max_tokens": 24,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    api = httpx.post(f"{vl_server.base_url}/v1/chat/completions", json=body, timeout=60).json()
    saved = json.loads(p.evaluate("() => localStorage.getItem('dflash.conversation')"))
    assert saved[-1]["content"] == api["choices"][0]["message"]["content"]
    assert answer.locator(".content").inner_text().strip()
    shot = shots / "chat-images.png"
    p.screenshot(path=str(shot), full_page=True)
    p.reload()
    assert p.locator("article.msg.user img.thumb").count() == 2
    print(f"\nscreenshot: {shot}")
    page.close()


def test_text_only_model_takes_no_images(browser: Any, server: RunningServer) -> None:
    page = Page(browser, server.base_url)
    p = page.page
    assert p.is_disabled("#attach")
    assert "no images" in (p.get_attribute("#attach", "title") or "")
    p.evaluate(DELIVER, ["paste", base64_png(), "a.png"])
    p.wait_for_function("() => document.getElementById('attach-note').textContent.length > 0")
    assert "takes no images" in p.inner_text("#attach-note")
    assert p.locator("#attachments .thumb").count() == 0 and page.errors == []
    page.close()


def base64_png() -> str:
    import base64

    return base64.b64encode(png(1, (32, 32))).decode()
