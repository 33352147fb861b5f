"""The page at `/` of `tuneforge serve`, in real headless Chromium (Debian's, driven by Playwright's Python
package; the Makefile's `install-dev`, run by `make test`, puts it in place): a chat model streams its answer
into the chat box, a classifier shows its label scores. Skipped, saying why, only where Chromium or Playwright
is not installed."""

from __future__ import annotations

import shutil

import httpx
import pytest

from conftest import save_tiny_classifier
from test_serve_generate import KEY, NAME, app_server, save_chat_model, wait_ready

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("no chromium on this machine: `make install` installs Debian's (apt-get install chromium, as root)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright Python package is missing: pip install -e '.[dev]'")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


def test_the_chat_page_streams_the_answer(browser, tmp_path, tiny_llama):
    model = save_chat_model(tmp_path / "chat", tiny_llama)
    with app_server(model, api_key=KEY) as url:
        wait_ready(url)
        assert httpx.get(url, timeout=10).status_code == 401  # the page is behind the key too
        want = httpx.post(
            f"{url}/v1/chat/completions",
            json={
                "model": NAME,
                "messages": [{"role": "user", "content": "where is the cat"}],
                "max_tokens": 12,
                "temperature": 0,
            },
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=60,
        ).json()["choices"][0]["message"]["content"]
        assert want

        context = browser.new_context(http_credentials={"username": "me", "password": KEY})  # the login prompt
        page = context.new_page()
        page.goto(url)
        page.wait_for_selector("#generate:not(.hidden)", timeout=30_000)
        page.fill("#max-tokens", "12")
        page.fill("#temperature", "0")
        page.evaluate(  # count the answer's updates as they arrive
            """() => { window.updates = 0; new MutationObserver((records) => { window.updates += records.length; })
                .observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true}); }"""
        )
        page.fill("#prompt", "where is the cat")
        page.click("#send")
        answer = page.wait_for_selector('.assistant[data-done="1"]', timeout=30_000)
        assert answer.text_content() == want
        assert page.evaluate("window.updates") > 3  # appended chunk by chunk as the stream came, not set once
        assert page.query_selector(".user").inner_text() == "where is the cat"
        context.close()


def test_the_classifier_page_shows_label_scores(browser, tmp_path, minilm_dir):
    from tuneforge.predict import Predictor

    model = save_tiny_classifier(tmp_path / "classifier", minilm_dir, {0: "neg", 1: "pos"})
    with app_server(model) as url:
        wait_ready(url)
        page = browser.new_page()
        page.goto(url)
        page.wait_for_selector("#predict:not(.hidden)", timeout=30_000)
        page.fill("#text", "a wonderful, moving film")
        page.click("#classify")
        page.wait_for_selector(".label-row", timeout=30_000)
        rows = [r.inner_text().split("\t")[:2] for r in page.query_selector_all(".label-row")]
        page.close()
    [want] = Predictor(model).predict(["a wonderful, moving film"])
    assert {label: float(score) for label, score in rows} == pytest.approx(want["scores"], abs=1e-3)
    assert rows[0][0] == want["label"]  # the best label first
