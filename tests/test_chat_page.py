"""The chat page at `/`: served with its CSP (plain HTTP, no browser), then used for real in
headless Chromium driven by Selenium against a `python -m server` process on a free loopback
port that serves a tiny random Llama with an API key.

The browser test needs the Debian packages chromium and chromium-driver (`make test` installs
them when it can); without them it skips and says so. The screenshot it takes lands in
tests/artifacts/ (or $MINIVLLM_TEST_ARTIFACTS).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

from server.app import create_app
from tests.conftest import TINY_LLAMA, make_tiny_llama, save_tiny_tokenizer
from tests.test_server import _free_port
from tests.test_server_units import fake_llm

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,860",
]
API_KEY = "page-key-9c1e"
# The tiny tokenizer knows only w3..w127: w3 opens a user turn, w4 an assistant turn.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ 'w3 ' if m['role'] == 'user' else 'w4 ' }}{{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}w4{% endif %}"
)
# A long context so a generation that the Stop test interrupts would run for seconds.
MAX_MODEL_LEN = 2048
ENGINE_ARGS = [
    "--max-num-seqs",
    "4",
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--max-num-batched-tokens",
    "64",
    "--num-pages",
    "160",
]
STARTUP_TIMEOUT_S = 300
ANSWER_TIMEOUT_S = 120
SETTINGS = {"temperature": 0, "top_p": 1, "max_tokens": 12, "seed": 7}


def artifacts_dir() -> Path:
    path = Path(os.environ.get("MINIVLLM_TEST_ARTIFACTS") or ROOT / "tests" / "artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------------- the page over plain HTTP


class InlineBlocks(HTMLParser):
    """The text of every <script> and <style> element, as a browser's parser delimits them."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=False)
        self.found: dict[str, list[str]] = {"script": [], "style": []}
        self._open: str | None = None

    def handle_starttag(self, tag, attrs):
        if tag in self.found:
            self._open = tag
            self.found[tag].append("")

    def handle_endtag(self, tag):
        self._open = None

    def handle_data(self, data):
        if self._open is not None:
            self.found[self._open][-1] += data


def test_page_is_served_without_a_key_with_a_strict_csp():
    with TestClient(create_app(fake_llm(), model_name="fake", api_key=API_KEY)) as client:
        r = client.get("/")
        assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
        html = r.text
        assert "<title>minivllm-jax chat</title>" in html and 'id="prompt"' in html
        csp = dict(d.strip().split(" ", 1) for d in r.headers["content-security-policy"].split(";"))
        assert csp["default-src"] == "'none'" and csp["connect-src"] == "'self'"
        assert csp["frame-ancestors"] == "'none'" and csp["base-uri"] == "'none'"
        # Inline code runs by hash only: exactly the page's one script and one style block, as an
        # HTML parser (not the server's own extraction) finds them.
        blocks = InlineBlocks()
        blocks.feed(html)
        for tag, directive in (("script", "script-src"), ("style", "style-src")):
            (block,) = blocks.found[tag]
            digest = base64.b64encode(hashlib.sha256(block.encode()).digest()).decode()
            assert csp[directive] == f"'sha256-{digest}'"
        assert "unsafe" not in r.headers["content-security-policy"]
        assert r.headers["x-content-type-options"] == "nosniff"
        # Nothing loaded from elsewhere, and model text is never parsed as HTML.
        assert (
            not re.search(r"(src|href)\s*=", html)
            and "innerHTML" not in html
            and "http://" not in html
        )
        assert client.get("/v1/models").status_code == 401  # the page is public, the API is not
        metrics = client.get(
            "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}
        )  # behind the key too
        assert 'minivllm_http_requests_total{method="GET",route="/",status="200"} 1' in metrics.text


def test_page_is_served_while_the_model_loads():
    loaded = threading.Event()

    def load():
        loaded.wait(30)
        return fake_llm()

    with TestClient(create_app(load, model_name="fake")) as client:
        assert client.get("/health").status_code == 503
        assert client.get("/").status_code == 200  # it shows the loading state itself
        loaded.set()


# ---------------------------------------------------------------------- the page in a browser


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    model = tmp_path_factory.mktemp("chat-page") / "tiny"
    import torch

    hf = make_tiny_llama(model, max_position_embeddings=MAX_MODEL_LEN)
    # EOS's logit is then always 0 while some other one is positive, so greedy answers run to
    # max_tokens: only the Stop button can end one early.
    with torch.no_grad():
        hf.lm_head.weight[TINY_LLAMA["eos_token_id"]] = 0
    hf.save_pretrained(model)
    save_tiny_tokenizer(model, chat_template=CHAT_TEMPLATE)
    port = _free_port()
    log = model.parent / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "server",
        "--model",
        str(model),
        "--port",
        str(port),
        "--api-key",
        API_KEY,
        "--log-level",
        "warning",
        *ENGINE_ARGS,
    ]
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert proc.poll() is None, (
                f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            )
            assert time.monotonic() < deadline, (
                f"not ready after {STARTUP_TIMEOUT_S}s:\n{log.read_text()[-3000:]}"
            )
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.skip(
            f"{' and '.join(missing)} not found: install Debian packages chromium and chromium-driver "
            "(`apt-get install chromium chromium-driver`; `make test` does it when run as root)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: Selenium Manager never runs, so nothing is downloaded.
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def direct_answer(url: str, messages: list[dict], **settings) -> tuple[str, dict]:
    """The same request as the page's, over the WebSocket from Python: (text, done message)."""
    import websockets

    async def ask() -> tuple[str, dict]:
        ws_url = url.replace("http://", "ws://") + "/v1/stream"
        async with websockets.connect(
            ws_url, additional_headers={"Authorization": f"Bearer {API_KEY}"}
        ) as ws:
            await ws.send(json.dumps({"messages": messages, **settings}))
            text = ""
            while (msg := json.loads(await ws.recv()))["type"] == "token":
                text += msg["text"]
            assert msg["type"] == "done", msg
            return text, msg

    return asyncio.run(asyncio.wait_for(ask(), ANSWER_TIMEOUT_S))


def set_field(driver, element_id: str, value) -> None:
    field = driver.find_element("id", element_id)
    field.clear()
    field.send_keys(str(value))


def ask_in_page(driver, prompt: str, stats: bool = True) -> dict:
    """Type `prompt`, send it, wait until the answer ends; the answer box's text and stats (or
    its error message)."""
    from selenium.webdriver.support.ui import WebDriverWait

    before = len(driver.find_elements("css selector", ".msg.assistant"))
    set_field(driver, "prompt", prompt)
    driver.find_element("id", "send").click()
    wait = WebDriverWait(driver, ANSWER_TIMEOUT_S, poll_frequency=0.05)
    box = wait.until(
        lambda d: (
            (boxes := d.find_elements("css selector", ".msg.assistant"))
            and len(boxes) > before
            and boxes[-1]
        )
    )
    wait.until(lambda d: box.get_attribute("data-state") != "streaming")
    return answer_shown(box, stats)


def answer_shown(box, stats: bool = True) -> dict:
    """An ended answer as the page shows it: state, text, and the stats or the error message."""
    shown = {
        "state": box.get_attribute("data-state"),
        "text": box.find_element("css selector", ".text").get_property("textContent"),
    }
    if stats:
        shown.update(
            {
                name: box.find_element("css selector", f".stats .{name}").text
                for name in ("ttft", "tps", "ntokens", "finish")
            }
        )
    else:
        shown["error"] = box.find_element("css selector", ".error").text
    return shown


def test_chat_page_streams_answers_in_chromium(browser, server_url):
    driver = browser
    open_page(driver, server_url, API_KEY)
    assert driver.title == "minivllm-jax chat"

    conversation = []
    for prompt in ("w5 w9 w17", "w21 w8"):
        conversation.append({"role": "user", "content": prompt})
        expected, done = direct_answer(server_url, conversation, **SETTINGS)
        assert (
            expected and done["usage"]["completion_tokens"] >= 2
        )  # enough tokens for a decode rate
        shown = ask_in_page(driver, prompt)
        # The same text as a direct request; a decode rate means it came in several token messages.
        assert shown["state"] == "done" and shown["text"] == expected, (shown, expected)
        assert shown["finish"] == done["finish_reason"], (shown, done)
        assert int(shown["ntokens"]) == done["usage"]["completion_tokens"], (shown, done)
        assert float(shown["ttft"]) > 0 and float(shown["tps"]) > 0, shown
        conversation.append(
            {"role": "assistant", "content": expected}
        )  # the page keeps the conversation

    driver.save_screenshot(str(artifacts_dir() / "chat_page.png"))
    # The CSP let the page do all of that: nothing was refused.
    refused = [
        e["message"] for e in driver.get_log("browser") if "Content Security Policy" in e["message"]
    ]
    assert not refused, refused


def open_page(driver, url: str, key: str) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url + "/")
    WebDriverWait(driver, 30).until(lambda d: d.find_element("id", "status").text == "ready")
    set_field(driver, "api_key", key)
    for name, value in SETTINGS.items():
        set_field(driver, name, value)


def test_stop_ends_a_generation_and_keeps_what_streamed(browser, server_url):
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser
    open_page(driver, server_url, API_KEY)
    max_tokens = MAX_MODEL_LEN - 48
    set_field(driver, "max_tokens", max_tokens)
    set_field(driver, "prompt", "w30 w31 w32")
    driver.find_element("id", "send").click()
    wait = WebDriverWait(driver, ANSWER_TIMEOUT_S, poll_frequency=0.02)
    wait.until(
        lambda d: d.find_elements("css selector", ".msg.assistant .ttft")
    )  # the first token is in
    driver.find_element("id", "stop").click()
    answer = driver.find_elements("css selector", ".msg.assistant")[-1]
    wait.until(lambda d: answer.get_attribute("data-state") != "streaming")
    shown = answer_shown(answer)
    n = int(shown["ntokens"])
    assert shown["state"] == "done" and shown["finish"] == "abort" and 0 < n < max_tokens, shown
    # What streamed before the stop is the start of the full greedy answer.
    settings = {**SETTINGS, "max_tokens": n}
    assert (
        shown["text"]
        == direct_answer(server_url, [{"role": "user", "content": "w30 w31 w32"}], **settings)[0]
    )
    assert driver.find_element("id", "stop").get_property("disabled")
    assert not driver.find_element("id", "send").get_property("disabled")


def test_errors_show_the_servers_message_and_drop_the_failed_turn(browser, server_url):
    driver = browser
    open_page(driver, server_url, "not-the-key")
    shown = ask_in_page(driver, "w40", stats=False)
    assert shown["state"] == "error" and "invalid API key" in shown["error"]

    set_field(driver, "api_key", API_KEY)
    set_field(driver, "temperature", -1)
    shown = ask_in_page(driver, "w41", stats=False)
    assert shown["state"] == "error" and "temperature" in shown["error"]
    assert len(driver.find_elements("css selector", ".msg.user.dropped")) == 2

    # Neither failed prompt stays in the conversation: the next answer is that of a fresh chat.
    set_field(driver, "temperature", 0)
    shown = ask_in_page(driver, "w42")
    assert shown["state"] == "done"
    assert (
        shown["text"]
        == direct_answer(server_url, [{"role": "user", "content": "w42"}], **SETTINGS)[0]
    )
