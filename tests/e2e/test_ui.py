"""The chat page at ``/``, driven in a real browser: Debian's chromium under Playwright
for Python (Playwright's own browser download cannot be fetched here, so it is pointed
at the system binary; ``make test`` installs chromium where it can). The server is the
real SmolLM2 behind API keys."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import KEY_Q, _serve
from e2e_server import KEY_A, EmberServer, served_weights

pytestmark = pytest.mark.slow
sync_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("needs Debian's chromium (make test installs it where it can)",
                allow_module_level=True)

# what a model's reply may try: markup that would run if it were ever parsed as HTML
MARKUP = "<img src=x onerror=window.__xss=1><script>window.__xss=2</script>"


@pytest.fixture(scope="module")
def ui_server(observed_server) -> EmberServer:
    return observed_server[0]


@pytest.fixture(scope="module")
def browser() -> Iterator:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        yield b
        b.close()


@pytest.fixture
def page(browser, ui_server: EmberServer):
    """A fresh browser profile on the page, signed in with tenant A's key as the HTTP
    Basic password; no script error may happen on it."""
    context = browser.new_context(http_credentials={"username": "me", "password": KEY_A})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("dialog", lambda d: errors.append(f"dialog: {d.message}"))
    page.goto(ui_server.url + "/")
    yield page
    context.close()
    assert not errors, errors


def configure(page, **fields: str) -> None:
    """Open Settings, fill fields by their labels, save."""
    page.get_by_role("button", name="Settings").click()
    dialog = page.get_by_role("dialog", name="Settings")
    for label, value in fields.items():
        field = dialog.get_by_label(label, exact=True)
        if field.evaluate("e => e.tagName") == "SELECT":
            field.select_option(value)
        else:
            field.fill(value)
    dialog.get_by_role("button", name="Save").click()


def send(page, text: str) -> None:
    page.get_by_label("Message", exact=True).fill(text)
    page.get_by_role("button", name="Send").click()


def replies(page):
    return page.locator("article[aria-label=Assistant]")


def wait_done(page, n: int = 1) -> None:
    page.wait_for_function(
        "n => { const a = document.querySelectorAll('article[aria-label=Assistant]');"
        " return a.length === n && a[n - 1].dataset.state !== 'streaming'; }", arg=n,
        timeout=60_000)


def test_a_reply_streams_in_token_by_token_and_the_history_survives_a_reload(page):
    configure(page, **{"API key": KEY_A, "Temperature": "0", "Max tokens": "48"})
    page.evaluate("""() => {
        window.__lengths = [];
        new MutationObserver(() => {
            const a = document.querySelectorAll('article[aria-label=Assistant] .body');
            if (a.length) window.__lengths.push(a[a.length - 1].textContent.length);
        }).observe(document.getElementById('messages'),
                   {childList: true, subtree: true, characterData: true});
    }""")
    send(page, "Write a short poem about the sea.")
    wait_done(page)
    lengths = page.evaluate("window.__lengths")
    assert len(set(lengths)) >= 4 and lengths == sorted(lengths), lengths  # it grew
    reply = replies(page).first
    assert reply.get_attribute("data-state") == "done"
    text = reply.locator(".body").inner_text()
    stats = reply.locator(".stats").inner_text()
    assert "tokens" in stats and "TTFT" in stats and "tokens/s" in stats, stats
    page.reload()
    assert page.get_by_role("button", name="Write a short poem about the sea.",
                            exact=True).count() == 1
    assert page.locator("article[aria-label=You]").inner_text().startswith("Write a short")
    assert replies(page).first.locator(".body").inner_text() == text


def test_stop_aborts_the_request_and_frees_its_kv_blocks(page, ui_server):
    def running() -> tuple[float, float]:
        m = ui_server.metrics()
        return m["ember_requests_running"], m["ember_kv_blocks_used"]

    assert running() == (0, 0)
    configure(page, **{"API key": KEY_A, "Temperature": "0", "Max tokens": "1500"})
    send(page, "Write a long story about a dragon who learns to cook.")
    page.wait_for_function("() => { const b = document.querySelector("
                           "'article[aria-label=Assistant] .body');"
                           " return b && b.textContent.length > 20; }", timeout=60_000)
    assert running()[0] == 1
    page.get_by_role("button", name="Stop").click()
    wait_done(page)
    assert replies(page).first.get_attribute("data-state") == "stopped"
    deadline = time.monotonic() + 10
    while running() != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running() == (0, 0)
    assert "client disconnected" in ui_server.log()
    assert page.get_by_role("button", name="Send").is_enabled()


def test_regenerate_edit_and_the_conversation_list(page):
    configure(page, **{"API key": KEY_A, "Temperature": "0", "Max tokens": "8"})
    send(page, "Name a colour.")
    wait_done(page)
    page.get_by_role("button", name="Regenerate").click()
    wait_done(page)
    # the same prompt again: its prefix came from the cache
    assert "cached prompt tokens" in replies(page).first.locator(".stats").inner_text()
    cached = int(replies(page).first.locator(".stats").inner_text()
                 .split(" cached prompt tokens")[0].split("·")[-1].strip())
    assert cached > 0
    page.get_by_role("button", name="Edit message").click()
    page.get_by_label("Edited message").fill("Name an animal.")
    page.get_by_role("button", name="Save and send").click()
    wait_done(page)
    assert page.locator("article").count() == 2
    assert page.locator("article[aria-label=You]").inner_text().startswith("Name an animal.")
    # a second conversation, renamed; the first deleted; all kept across a reload
    page.get_by_role("button", name="New chat").click()
    assert page.locator("article").count() == 0
    send(page, "Say hi.")
    wait_done(page)
    page.get_by_role("button", name="Rename Say hi.").click()
    title = page.get_by_label("Conversation title")
    title.fill("Greetings")
    title.press("Enter")
    page.get_by_role("button", name="Delete Name a colour.").click()
    page.reload()
    items = page.locator("#conversations li")
    assert items.count() == 1 and items.first.inner_text().startswith("Greetings")
    assert page.locator("article[aria-label=You]").inner_text().startswith("Say hi.")


def test_markup_in_a_reply_stays_inert_and_json_schema_mode_returns_that_json(page):
    """The model is made (by a JSON schema with a constant) to answer with an <img
    onerror> and a <script>: they show as text, nothing runs, no element is made; the
    reply parses as the schema's JSON. A user's markup and the markdown renderer's code
    blocks and links are inert too."""
    page.evaluate("window.__xss = 0")
    schema = {"type": "object", "properties": {"html": {"const": MARKUP}},
              "required": ["html"], "additionalProperties": False}
    configure(page, **{"API key": KEY_A, "Temperature": "0", "Max tokens": "64",
                       "Response format": "json_schema", "JSON schema": json.dumps(schema)})
    send(page, "Reply in JSON. <img src=x onerror=window.__xss=3>")
    wait_done(page)
    reply = replies(page).first.locator(".body").inner_text()
    assert json.loads(reply) == {"html": MARKUP}
    assert page.locator("#messages img, #messages script").count() == 0
    assert "<img src=x onerror=window.__xss=3>" in page.locator("article[aria-label=You]"
                                                                 ).inner_text()
    rendered = page.evaluate("""() => {
        const box = document.createElement('div');
        box.append(markdown('**bold** [x](javascript:window.__xss=4) [ok](https://example.com)' +
                            '\\n\\n```html\\n<script>window.__xss=5</script>\\n```'));
        document.body.append(box);
        return {strong: box.querySelector('strong')?.textContent,
                links: [...box.querySelectorAll('a')].map(a => a.href),
                code: box.querySelector('pre code')?.textContent,
                copy: !!box.querySelector('button.copy'),
                scripts: box.querySelectorAll('script').length};
    }""")
    assert rendered == {"strong": "bold", "links": ["https://example.com/"],
                        "code": "<script>window.__xss=5</script>", "copy": True, "scripts": 0}
    assert page.evaluate("window.__xss") == 0


def test_a_wrong_key_shows_a_401_banner(page):
    configure(page, **{"API key": "sk-wrong-key-000000"})
    banner = page.get_by_role("alert")
    banner.wait_for()
    assert "401" in banner.inner_text()


def test_a_429_banner_counts_down_its_retry_after_before_send_is_allowed(page):
    configure(page, **{"API key": KEY_Q, "Max tokens": "4"})
    send(page, "Hello?")
    banner = page.get_by_role("alert")
    page.wait_for_function("() => /429/.test(document.getElementById('banner').textContent)")
    assert "Retry in" in banner.inner_text() and "max_queued=0" in banner.inner_text()
    assert page.get_by_role("button", name="Send").is_disabled()
    page.wait_for_function("() => !document.getElementById('send').disabled", timeout=5000)
    assert "send again" in banner.inner_text()
    assert replies(page).count() == 0


def test_the_page_is_behind_the_keys_and_says_what_may_run(ui_server):
    r = httpx.get(ui_server.url + "/", timeout=10)
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic")
    r = httpx.get(ui_server.url + "/", auth=("me", "sk-wrong"), timeout=10)
    assert r.status_code == 401
    for path in ("/", "/ui/app.js", "/ui/style.css"):
        r = httpx.get(ui_server.url + path, auth=("me", KEY_A), timeout=10)
        assert r.status_code == 200 and "script-src 'self'" in r.headers["content-security-policy"]
    r = httpx.get(ui_server.url + "/ui/../app.py", auth=("me", KEY_A), timeout=10)
    assert r.status_code == 404
    r = httpx.get(ui_server.url + "/", headers={"Authorization": f"Bearer {KEY_A}"}, timeout=10)
    assert r.status_code == 200 and "<textarea id=\"message\"" in r.text


def test_no_ui_turns_the_page_off(tiny_gguf: Path, e2e_log_dir: Path):
    serving = _serve(tiny_gguf, e2e_log_dir, "--no-ui")
    server = next(serving)
    try:
        assert httpx.get(server.url + "/", timeout=10).status_code == 404
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        serving.close()


THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
            "{% endif %}")


def test_reasoning_is_shown_collapsed_apart_from_the_answer(browser, smollm2_gguf: Path,
                                                            e2e_log_dir: Path, tmp_path):
    """A template that opens the reasoning in the prompt: what the model says before
    </think> is reasoning_content, shown in a collapsed "Reasoning" block, not in the
    answer."""
    template = tmp_path / "thinking.jinja"
    template.write_text(THINKING)
    serving = _serve(smollm2_gguf, e2e_log_dir, "--chat-template", str(template),
                     weights=served_weights())
    server = next(serving)
    try:
        page = browser.new_page()
        page.goto(server.url + "/")
        configure(page, **{"Temperature": "0", "Max tokens": "24"})
        send(page, "Is 17 a prime number?")
        wait_done(page)
        reasoning = replies(page).first.locator("details.reasoning")
        assert reasoning.count() == 1 and reasoning.get_attribute("open") is None
        thought = reasoning.locator("div").text_content()
        assert thought.strip() and thought.strip() not in replies(page).first.locator(
            ".body").text_content()
        page.close()
    finally:
        serving.close()


def test_a_server_that_went_away_shows_a_banner(browser, tiny_gguf: Path, e2e_log_dir: Path):
    serving = _serve(tiny_gguf, e2e_log_dir)
    server = next(serving)
    page = browser.new_page()
    try:
        page.goto(server.url + "/")
        page.get_by_label("Message", exact=True).wait_for()
    finally:
        serving.close()  # the server stops; the page stays
    send(page, "Anyone there?")
    banner = page.get_by_role("alert")
    banner.wait_for()
    assert "not reachable" in banner.inner_text()
    assert replies(page).first.get_attribute("data-state") == "error"
    page.close()


def test_emptied_settings_mean_defaults_and_a_damaged_store_starts_afresh(page):
    configure(page, **{"API key": KEY_A, "Max tokens": "", "Temperature": "", "Top-p": ""})
    body = page.evaluate("requestBody({messages: []})")
    assert (body["max_tokens"], body["temperature"], body["top_p"]) == (512, 0.7, 1)
    page.wait_for_function("() => document.getElementById('model-name').textContent")
    page.evaluate("""() => {  // damage the stored conversations, keep the settings
        const saved = JSON.parse(localStorage.getItem('ember.chat.v1'));
        saved.convs = [{id: 'x'}, null, {id: 'y', messages: []}];
        localStorage.setItem('ember.chat.v1', JSON.stringify(saved));
    }""")
    page.reload()
    send(page, "Hi.")
    wait_done(page)
    assert page.locator("#conversations li").count() == 2
