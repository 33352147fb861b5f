"""The page at `/` of `tuneforge serve`, in real headless Chromium (Debian's, driven by Playwright's Python
package; the Makefile's `install-dev`, run by `make test`, puts it in place), against real servers of tiny models:
a conversation streams with its system prompt, history, sampling fields and token count; the stop button ends a
stream and the server cancels it; a model without a chat template is continued through /v1/completions; a
classifier's scores are bars; a sentence encoder shows the cosine similarity of two texts; behind a proxy's path
prefix the page's requests go under it. The Markdown renderer
is driven by crafted streams (page.route): a tiny random model cannot be asked for a code block or a hostile tag.
Skipped, saying why, only where Chromium or Playwright is not installed."""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import shutil
import threading
import time

import httpx
import pytest

from conftest import save_tiny_causal_lm, save_tiny_classifier
from test_serve_generate import KEY, NAME, app_server, save_chat_model, wait_ready
from test_serve_isolation import save_bert_task_model

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = 3000  # tokens asked for by the stream that is stopped: half a minute of generation here, stopped in a second


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


@pytest.fixture(scope="module")
def chat_url(browser, tmp_path_factory):
    """A served chat model (behind the key) whose greedy answers never end by themselves: the tiny random Llama with
    a context of 4096 and its end-of-text row of the output layer zeroed (a logit of 0 is never the largest of
    ~300 random ones), so a long stream runs until it is stopped."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("page-chat")
    heads = dict(num_attention_heads=4, num_key_value_heads=2)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=4096, **heads)
    base = save_tiny_causal_lm(root / "base", LlamaForCausalLM, LlamaConfig, **sizes)
    model_dir = save_chat_model(root / "chat", base)
    model = LlamaForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        model.lm_head.weight[model.config.eos_token_id] = 0
    model.save_pretrained(model_dir)
    with app_server(model_dir, api_key=KEY) as url:
        wait_ready(url)
        yield url


@pytest.fixture
def chat_page(browser, chat_url):
    context = browser.new_context(http_credentials={"username": "me", "password": KEY})  # the login prompt
    page = context.new_page()
    page.goto(chat_url)
    page.wait_for_selector("#generate:not(.hidden)", timeout=30_000)
    yield page
    context.close()


def request_bodies(page, route: str) -> list[dict]:
    """The JSON bodies of the page's requests to `route`, as Chromium sends them."""
    bodies: list[dict] = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data)) if r.url.endswith(route) else None)
    return bodies


def ask(page, text: str, replies: int = 1):
    page.fill("#prompt", text)
    page.click("#send")
    page.wait_for_selector(f'.assistant[data-done="1"] >> nth={replies - 1}', timeout=30_000)
    return page.query_selector_all(".assistant")[replies - 1]


def metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_a_conversation_streams_with_its_system_prompt_history_sampling_and_token_count(chat_page, chat_url):
    page = chat_page
    assert httpx.get(chat_url, timeout=10).status_code == 401  # the page is behind the key too
    system = {"role": "system", "content": "Answer in one word."}
    first = {"role": "user", "content": "where is the cat"}
    direct = {"model": NAME, "messages": [system, first], "max_tokens": 12, "temperature": 0}
    want = httpx.post(f"{chat_url}/v1/chat/completions", json=direct, headers=AUTH, timeout=60).json()
    sent = request_bodies(page, "/v1/chat/completions")
    page.fill("#system", system["content"])
    page.fill("#max-tokens", "12")
    page.fill("#temperature", "0")
    page.fill("#top-p", "0.9")
    page.evaluate(  # count the answer's updates as they arrive
        """() => { window.updates = 0; new MutationObserver((records) => { window.updates += records.length; })
            .observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true}); }"""
    )
    reply = ask(page, first["content"])
    assert page.evaluate("window.updates") > 3  # rendered again chunk by chunk as the stream came, not set once
    assert page.query_selector(".user").inner_text() == first["content"]
    stats = reply.query_selector(".stats").inner_text()
    assert f"{want['usage']['completion_tokens']} tokens · " in stats and " tokens/s" in stats, stats
    assert reply.get_attribute("data-finish") == "length"

    ask(page, "and the dog", replies=2)
    answer = {"role": "assistant", "content": want["choices"][0]["message"]["content"]}
    assert sent[0] == {
        "model": NAME,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 12,
        "temperature": 0,
        "top_p": 0.9,
        "messages": [system, first],
    }
    assert sent[1]["messages"] == [system, first, answer, {"role": "user", "content": "and the dog"}]


def test_the_stop_button_ends_the_stream_and_the_server_cancels_the_sequence(chat_page, chat_url, capfd):
    page = chat_page
    capfd.readouterr()
    page.fill("#max-tokens", str(LONG))
    page.fill("#temperature", "0")
    page.fill("#prompt", "tell me everything")
    page.click("#send")
    page.wait_for_function("() => document.querySelector('.assistant .content').textContent.length > 20")
    assert page.is_disabled("#send") and page.is_enabled("#stop")
    page.click("#stop")
    reply = page.wait_for_selector('.assistant[data-done="1"]', timeout=10_000)
    assert reply.get_attribute("data-finish") == "stopped" and "stopped after" in reply.inner_text()
    assert page.is_enabled("#send") and page.is_disabled("#stop")

    deadline, log = time.monotonic() + 10, ""
    while "POST /v1/chat/completions" not in log:  # the request's access line: written when it ended
        assert time.monotonic() < deadline, "the server did not end the stopped request"
        time.sleep(0.05)
        log += capfd.readouterr().err
    line = next(x for x in log.splitlines() if x.startswith("POST /v1/chat/completions"))
    assert 0 < int(line.rsplit("completion_tokens=", 1)[1]) < LONG, line
    metrics = httpx.get(f"{chat_url}/metrics", headers=AUTH, timeout=10).text
    generated = metric(metrics, "tuneforge_generated_tokens_total")
    time.sleep(0.3)
    metrics = httpx.get(f"{chat_url}/metrics", headers=AUTH, timeout=10).text
    assert metric(metrics, "tuneforge_running_sequences") == 0
    assert metric(metrics, "tuneforge_generated_tokens_total") == generated  # nothing generates any more


def sse(pieces: list[str]) -> str:
    """A chat stream as the server sends it, the reply in `pieces`, with its usage."""
    base = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0, "model": NAME}
    deltas = [{"role": "assistant", "content": ""}, *({"content": p} for p in pieces)]
    chunks = [{**base, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    chunks.append({**base, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}})
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def crafted_reply(page, pieces: list[str], message: str = "hello", replies: int = 1):
    """The page's next chat request answered with `pieces` (the server is not asked); returns the reply's node."""
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(status=200, content_type="text/event-stream", body=sse(pieces)),
    )
    return ask(page, message, replies)


HOSTILE = [
    "Look: <scr",
    "ipt>window.pwned = 'script'</script> and <img src=x onerror=\"window.pwned = 'img'\">",
    "\n\n**<img src=x onerror=\"window.pwned = 'bold'\">** [click](javascript:window.pwned='link')",
    " <a href=\"javascript:window.pwned='a'\">a</a> ![pic](http://127.0.0.1:9/p.png)",
    "\n\n```html\n<svg onload=\"window.pwned = 'code'\"></svg>\n```\n",
]


def test_model_output_never_runs_as_html_or_script_and_is_shown_as_written(chat_page):
    page = chat_page
    reply = crafted_reply(page, HOSTILE)
    page.wait_for_timeout(500)  # time for an image's onerror, had one been made
    assert page.evaluate("window.pwned") is None
    assert reply.query_selector_all("img, script, svg, iframe, [onerror], [onload]") == []
    assert [a.get_attribute("href") for a in reply.query_selector_all("a")] == ["http://127.0.0.1:9/p.png"]
    shown = reply.query_selector(".content").inner_text()
    assert "Look: <script>window.pwned = 'script'</script> and <img src=x onerror=\"window.pwned = 'img'\">" in shown
    assert "[click](javascript:window.pwned='link') <a href=\"javascript:window.pwned='a'\">a</a>" in shown
    assert reply.query_selector("strong").inner_text() == "<img src=x onerror=\"window.pwned = 'bold'\">"
    assert reply.query_selector("a").inner_text() == "image: pic"  # a link, never loaded
    assert reply.query_selector("pre code").inner_text() == "<svg onload=\"window.pwned = 'code'\"></svg>"


DIRECTIONS = """() => ['.user', '.assistant', '#prompt', '#system'].map(
    (selector) => getComputedStyle(document.querySelectorAll(selector)[0]).direction)"""


def test_right_to_left_messages_and_text_boxes_are_laid_out_right_to_left(chat_page):
    """An Arabic message and reply were laid out left to right, their punctuation at the wrong end; each message and
    text box takes the direction of its own text (dir=auto, as chat pages do), English staying left to right, and
    code left to right wherever it is."""
    page = chat_page
    page.fill("#system", "أجب بإيجاز.")
    reply = crafted_reply(page, ["مرحبا بك!\n\n```python\nprint('hi')\n```"], message="كيف حالك؟")
    page.fill("#prompt", "شكرا")
    arabic = page.evaluate(DIRECTIONS)
    assert reply.eval_on_selector(".code", "(e) => getComputedStyle(e).direction") == "ltr"  # code reads left to right
    page.click("#clear")
    page.fill("#system", "Answer briefly.")
    crafted_reply(page, ["Fine, thanks!"], message="how are you?")
    page.fill("#prompt", "thanks")
    assert (arabic, page.evaluate(DIRECTIONS)) == (["rtl"] * 4, ["ltr"] * 4)


def test_a_conversation_past_the_context_says_to_start_a_new_one(chat_page):
    """Once the conversation, sent whole with each message, outgrew the context, every message was refused with the
    server's 'the prompt has N tokens ...: shorten it', for a message of two words: the page says the conversation
    is sent with each message and New conversation starts afresh, which then answers."""
    page = chat_page
    page.fill("#max-tokens", "3")
    crafted_reply(page, ["word " * 5000])  # a long answer, kept in the conversation
    page.unroute("**/v1/chat/completions")
    refused = ask(page, "and now?", replies=2).query_selector(".error-text").inner_text()
    page.click("#clear")
    answered = ask(page, "and now?")
    assert refused.startswith("the prompt has ") and "the model's context is 4096" in refused, refused
    assert "the conversation so far is sent with each message: New conversation starts afresh" in refused
    assert answered.get_attribute("class") == "msg assistant" and "3 tokens" in answered.inner_text()


MARKDOWN = [
    "# Sorting\n\nUse **`sorted`**, not *my_own_sort*; ~~never~~ ",
    "see [the docs](https://docs.python.org/3/howto/sorting.html) or <https://example.org>.\n\n",
    "- first\n- second\n  1. nested\n\n> quoted\n\n| a | b |\n|---|--:|\n| 1 | 2 |\n\n",
    "```python\ndef key(x):\n    return x['n']  # <b>not bold</b>\n",
    "```\n\n[local](/v1/models) and snake_case_name",
]


def test_markdown_replies_render_code_blocks_lists_links_and_tables(chat_page):
    reply = crafted_reply(chat_page, MARKDOWN)
    content = reply.query_selector(".content")

    def texts(selector: str) -> list[str]:
        return [e.inner_text() for e in content.query_selector_all(selector)]

    assert texts("h1") == ["Sorting"]
    assert texts("strong code") == ["sorted"] and texts("em") == ["my_own_sort"] and texts("del") == ["never"]
    links = [(a.inner_text(), a.get_attribute("href"), a.get_attribute("rel")) for a in content.query_selector_all("a")]
    assert links == [
        ("the docs", "https://docs.python.org/3/howto/sorting.html", "noopener noreferrer nofollow"),
        ("https://example.org", "https://example.org/", "noopener noreferrer nofollow"),
    ]
    assert texts("ul > li > ol > li") == ["nested"] and len(content.query_selector_all("ul > li")) == 2
    assert texts("blockquote") == ["quoted"] and texts("th") == ["a", "b"] and texts("td") == ["1", "2"]
    code = content.query_selector("pre code")
    assert code.get_attribute("class") == "language-python"
    assert code.inner_text() == "def key(x):\n    return x['n']  # <b>not bold</b>"
    assert content.query_selector_all("b") == []
    assert "[local](/v1/models) and snake_case_name" in content.inner_text()  # a relative link is not followed
    assert "7 tokens" in reply.query_selector(".stats").inner_text()


def test_a_model_without_a_chat_template_is_continued_through_completions(browser, tiny_llama):
    with app_server(tiny_llama) as url:
        wait_ready(url)
        assert httpx.get(f"{url}/health", timeout=10).json()["chat"] is False
        direct = {"model": NAME, "prompt": "The dog", "max_tokens": 8, "temperature": 0}
        want = httpx.post(f"{url}/v1/completions", json=direct, timeout=60).json()
        page = browser.new_page()
        sent = request_bodies(page, "/v1/completions")
        page.goto(url)
        page.wait_for_selector("#generate:not(.hidden)", timeout=30_000)
        assert page.is_hidden("#system") and page.is_visible("#mode-note")
        page.fill("#max-tokens", "8")
        page.fill("#temperature", "0")
        shown = ask(page, "The dog").inner_text()
        ask(page, "A man", replies=2)
        page.close()
    assert [(b["prompt"], "messages" in b, b["stream_options"]) for b in sent] == [
        ("The dog", False, {"include_usage": True}),
        ("A man", False, {"include_usage": True}),  # each message on its own: no history for a base model
    ]
    assert f"{want['usage']['completion_tokens']} tokens" in shown


def test_a_seq2seq_model_is_said_to_answer_each_input_with_its_trained_length(browser, tiny_t5, tmp_path):
    """The page said a seq2seq model continues each message (it reads it as its input and answers it) and its empty
    max tokens meant 16: the note says what it does, the field shows the trained generation_max_length."""
    model_dir = tmp_path / "t5"
    shutil.copytree(tiny_t5, model_dir)
    (model_dir / "tuneforge.json").write_text(json.dumps({"task": "seq2seq", "generation_max_length": 24}))
    with app_server(str(model_dir)) as url:
        wait_ready(url)
        page = browser.new_page()
        page.goto(url)
        page.wait_for_selector("#generate:not(.hidden)", timeout=30_000)
        note, placeholder = page.inner_text("#mode-note"), page.get_attribute("#max-tokens", "placeholder")
        page.close()
    assert "continues" not in note and "each message is an input it answers" in note
    assert placeholder == "24"


BARS = """rows => rows.map((r) => {
    const width = (selector) => r.querySelector(selector).getBoundingClientRect().width;
    const shown = r.querySelector('.score-num').textContent;
    return [r.dataset.label, Number(r.dataset.score), shown, width('.bar') / width('.track')];
})"""  # each row of scores: its label, score, the score shown, and the bar's share of its track


def test_the_classifier_page_shows_label_scores_as_bars_once_per_request(browser, tmp_path, minilm_dir):
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
        rows = page.eval_on_selector_all(".label-row", BARS)
        sent = request_bodies(page, "/predict")
        page.dblclick("#classify")  # a double click: one request, one answer (both were shown, one under the other)
        page.wait_for_selector("#result .scores", timeout=30_000)
        page.wait_for_timeout(1000)  # time for a second answer, had a second request gone
        answers = len(page.query_selector_all("#result .scores"))
        page.close()
    assert (len(sent), answers) == (1, 1)
    [want] = Predictor(model).predict(["a wonderful, moving film"])
    assert {label: score for label, score, _, _ in rows} == pytest.approx(want["scores"], abs=1e-6)
    assert rows[0][0] == want["label"]  # the best label first
    for _, score, shown, width in rows:
        assert shown == f"{score:.3f}" and width == pytest.approx(score, abs=0.01)  # the bar is the score


def test_the_question_answering_page_asks_for_a_question_and_its_context(browser, tmp_path, minilm_dir):
    """A qa model takes (question, context) pairs only: the page names both boxes so, and a question sent without
    its context gets the server's word for it (it was parsed as the JSON of a request: a SyntaxError)."""
    from transformers import BertForQuestionAnswering

    from tuneforge.predict import load_predictor

    model = save_bert_task_model(tmp_path / "qa", minilm_dir, BertForQuestionAnswering, {"task": "qa"})
    question, context = "where does Peter live", "Peter lives in Berlin with his sister."
    with app_server(model) as url:
        wait_ready(url)
        page = browser.new_page()
        sent = request_bodies(page, "/predict")
        page.goto(url)
        page.wait_for_selector("#predict:not(.hidden)", timeout=30_000)
        boxes = [page.get_attribute(box, "placeholder") for box in ("#text", "#pair")]
        page.fill("#text", question)
        page.click("#classify")
        refused = page.wait_for_selector("#result.error", timeout=30_000).inner_text()
        page.fill("#pair", context)
        page.click("#classify")
        answer = json.loads(page.wait_for_selector("#result pre", timeout=30_000).inner_text())
        page.close()
    assert boxes == ["A question", "The context: the answer is a span of it"]
    assert sent == [{"pairs": [[question, ""]]}, {"pairs": [[question, context]]}]
    assert refused == "input 1: the context is empty; the answer is a span of it"
    assert answer == pytest.approx(load_predictor(model).predict([(question, context)])[0])


def test_the_sentence_encoder_page_shows_the_cosine_similarity_of_two_texts_once_per_request(browser, tiny_encoder):
    from tuneforge.tasks.sentence_encoder import SentenceEncoder

    texts = ["a wonderful, moving film", "the plot makes no sense at all"]
    with app_server(tiny_encoder) as url:
        wait_ready(url)
        page = browser.new_page()
        sent = request_bodies(page, "/v1/embeddings")
        page.goto(url)
        page.wait_for_selector("#embed:not(.hidden)", timeout=30_000)
        status = page.inner_text("#status")
        page.fill("#first", texts[0])
        page.fill("#second", texts[1])
        page.click("#compare")
        whole = page.wait_for_selector('#similarity[data-dimensions="32"]', timeout=30_000)
        shown = (float(whole.get_attribute("data-cosine")), whole.inner_text())
        page.fill("#dimensions", "8")
        page.click("#compare")
        short = page.wait_for_selector('#similarity[data-dimensions="8"]', timeout=30_000)
        shown_short = (float(short.get_attribute("data-cosine")), short.inner_text())
        bar = page.eval_on_selector_all(".label-row", BARS)
        page.dblclick("#compare")  # one request, one answer (both were shown, one under the other)
        page.wait_for_selector("#similarity .scores", timeout=30_000)
        page.wait_for_timeout(1000)  # time for a second answer, had a second request gone
        answers = len(page.query_selector_all("#similarity .scores"))
        page.close()
    assert (len(sent), answers) == (3, 1)
    assert status == f"{NAME} \u2014 sentence encoder, 32 dimensions, trained to keep its meaning in the first 16, 8"
    assert sent[:2] == [
        {"model": NAME, "input": texts, "encoding_format": "float"},
        {"model": NAME, "input": texts, "encoding_format": "float", "dimensions": 8},
    ]
    encoder = SentenceEncoder(tiny_encoder, device="cpu")
    for (cosine, text), dims in ((shown, None), (shown_short, 8)):
        a, b = encoder.encode(texts, dims=dims)
        assert cosine == pytest.approx(float(a @ b), abs=1e-5)
        assert f"{cosine:.4f}" in text
        assert f"{dims or 32} dimensions \u00b7 " in text and " tokens" in text
    assert abs(shown[0] - shown_short[0]) > 1e-4  # the slice is compared, not the whole vector again
    [(label, score, number, width)] = bar  # the last comparison's, as a bar of its own
    assert label == "cosine similarity" and score == shown_short[0] and number == f"{score:.4f}"
    assert width == pytest.approx(max(0.0, score), abs=0.01)


def test_sampling_fields_left_empty_are_left_out_and_a_value_is_sent_as_typed(chat_page):
    """An empty temperature was sent as 0 (greedy, where the server's default samples) and a top-p of 0 as 1 (the
    whole distribution): each is now left out when empty and sent as typed, the server saying what it refuses."""
    page = chat_page
    sent = request_bodies(page, "/v1/chat/completions")
    page.fill("#max-tokens", "3")
    page.fill("#temperature", "")
    page.fill("#top-p", "")
    ask(page, "hello")
    page.fill("#temperature", "0")
    page.fill("#top-p", "0")
    refused = ask(page, "hello again", replies=2)
    assert "temperature" not in sent[0] and "top_p" not in sent[0], sent[0]
    assert (sent[1]["temperature"], sent[1]["top_p"]) == (0, 0)
    assert "top_p" in refused.query_selector(".error-text").inner_text()


def test_the_page_works_under_a_reverse_proxys_path_prefix(browser, tiny_llama):
    """Behind a proxy serving the server at /tf/ (nginx's `location /tf/ { proxy_pass http://server/; }`, here the
    browser's own routing), the page's requests go under /tf/ too: they went to the proxy's /health, and the page
    said 'loading the model...' forever. The proxy's 502 page while the server is not up is shown and /health asked
    again (it was read as JSON: an uncaught SyntaxError, and the page stayed at 'loading the model...')."""
    with app_server(tiny_llama) as url:
        wait_ready(url)
        page = browser.new_page()

        health = []

        def proxy(route):
            path = route.request.url.removeprefix(url)
            if not path.startswith("/tf/"):
                return route.fulfill(status=404, body="not found")
            if path == "/tf/health" and len(health) < 2:  # the server not up yet (restarting): the proxy's own page
                health.append(path)
                return route.fulfill(status=502, content_type="text/html", body="<html>502 Bad Gateway</html>")
            route.fulfill(response=route.fetch(url=url + path.removeprefix("/tf")))

        page.route(f"{url}/**", proxy)
        sent = request_bodies(page, "/v1/completions")
        page.goto(f"{url}/tf/")
        page.wait_for_function("() => document.getElementById('status').textContent.includes('502')")
        page.wait_for_selector("#generate:not(.hidden)", timeout=30_000)  # asked again until the server answered
        page.fill("#max-tokens", "4")
        stats = ask(page, "The dog").query_selector(".stats").inner_text()
        page.close()
    assert len(sent) == 1 and "4 tokens" in stats


@contextlib.contextmanager
def other_site(html: str):
    """Another origin on this machine (a real server: Chromium keeps pages it cannot place on the network from
    framing local ones), answering `html` to every GET."""
    body = html.encode()

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def test_another_site_cannot_frame_the_page(browser, tiny_llama):
    """The page's Content-Security-Policy was a <meta> tag only, which cannot say who may frame it: any site could
    show the chat inside its own page (a click-jacking). The server's header refuses other origins' frames."""
    with app_server(tiny_llama) as url, other_site(f'<iframe src="{url}/"></iframe>') as framing:
        wait_ready(url)
        page = browser.new_page()
        page.goto(framing)
        page.wait_for_timeout(1500)
        frames = [frame.url for frame in page.frames]
        shown = page.frames[1].evaluate("() => document.getElementById('status') !== null")
        page.close()
    assert frames[1] != f"{url}/" and shown is False, frames  # the browser did not show it


def test_the_sampling_fields_start_empty_showing_the_models_own_defaults_and_are_left_out(
    browser, chat_model, tmp_path
):
    """The page sent a temperature of 0.7 and a top-p of 1 unless cleared, overriding the model's own defaults
    (its generation_config.json, which the server takes for the fields a request leaves out): the fields start empty,
    their placeholders the server's defaults, and an untouched field is left out."""
    folder = tmp_path / "model"
    shutil.copytree(chat_model, folder)
    settings = {"bos_token_id": 0, "eos_token_id": 0, "temperature": 0.6, "top_p": 0.9, "max_new_tokens": 3}
    (folder / "generation_config.json").write_text(json.dumps(settings))
    with app_server(str(folder)) as url:
        wait_ready(url)
        page = browser.new_page()
        page.goto(url)
        page.wait_for_selector("#generate:not(.hidden)", timeout=30_000)
        fields = ("max-tokens", "temperature", "top-p")
        shown = {f: (page.input_value(f"#{f}"), page.get_attribute(f"#{f}", "placeholder")) for f in fields}
        sent = request_bodies(page, "/v1/chat/completions")
        ask(page, "hello")
        page.close()
    assert shown == {"max-tokens": ("", "3"), "temperature": ("", "0.6"), "top-p": ("", "0.9")}
    assert not {"max_tokens", "temperature", "top_p"} & set(sent[0]), sent[0]
