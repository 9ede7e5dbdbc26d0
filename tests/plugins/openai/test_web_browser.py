"""The playground and the dashboard in a real browser (headless Chromium, Selenium): a chat
streamed into the page, the stop button aborting the request in the engine, the dashboard's
figures following a load, the API key asked for and sent. Screenshots: test-artifacts/web/."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from baton.testing.tiny_model import tiny_model

from .browser import browser_errors, chromium, screenshot, text_of, wait_until
from .conftest import ServerThread, metric, running_server, wait_for

KEY = "page-test-key"
ANSWER = '.message[data-role="assistant"]'
#: The dashboard test's load: requests of this many tokens, one at a time (max_num_seqs = 1).
LOAD_REQUESTS = 4
LOAD_TOKENS = 120
#: Seconds the load may take on a busy machine (2 shared cores).
LOAD_TIMEOUT = 180
#: The stop test's answer: long enough that it still runs when the click lands however busy the
#: machine (the tiny model writes ~1,200 tokens/s here, so 900 tokens could end before the click).
LONG_ANSWER = 30_000


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as driver:
        yield driver


@pytest.fixture(scope="module")
def keyed_server(model_dir: str) -> Iterator[ServerThread]:
    """An API key, and one request at a time: a second one waits in the queue."""
    with running_server(
        model_dir, max_num_seqs=1, cache={"kv_cache_memory": "64MiB"}, server={"api_key": KEY}
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def long_server() -> Iterator[ServerThread]:
    """A tiny model whose context holds ``LONG_ANSWER`` tokens."""
    model = tiny_model("llama", max_position_embeddings=LONG_ANSWER + 1024)
    with running_server(str(model), max_model_len=LONG_ANSWER + 1024) as srv:
        yield srv


#: Counts, from the moment it runs, the writes to any message's ``.content`` and the animation
#: frames the page gets (a page that keeps its main thread busy gets few).
COUNT_WRITES_AND_FRAMES = """
window.contentWrites = 0;
window.frames_ = 0;
(function tick() { window.frames_ += 1; requestAnimationFrame(tick); })();
new MutationObserver((records) => {
  for (const r of records) if (r.target.classList && r.target.classList.contains("content")) window.contentWrites += 1;
}).observe(document.getElementById("messages"), { childList: true, subtree: true, characterData: true });
"""


def open_page(driver: Any, url: str) -> None:
    driver.get(url)
    driver.execute_script("localStorage.clear(); sessionStorage.clear();")
    driver.get(url)


def fill(driver: Any, element_id: str, text: str) -> None:
    field = driver.find_element("id", element_id)
    field.clear()
    field.send_keys(text)


def key_asked(driver: Any) -> bool:
    return driver.find_element("id", "key-dialog").get_attribute("open") is not None


def enter_key(driver: Any, key: str) -> None:
    wait_until(driver, key_asked, "the API key dialog")
    fill(driver, "key-input", key)
    driver.find_element("id", "key-submit").click()


def finished(driver: Any) -> tuple[int, ...]:
    """The dashboard's finished requests by reason: stop, length, abort, error."""
    return tuple(int(n) for n in text_of(driver, "#engine-0 [data-figure=finished]").split(" / "))


def answer_done(driver: Any, selector: str = ANSWER) -> str | None:
    """How the answer ``selector`` matches ended: finished, stopped, or None while it runs."""
    return driver.execute_script(f"return document.querySelector('{selector}')?.dataset.done")


def ready(driver: Any) -> bool:
    return driver.execute_script("return document.body.dataset.ready === 'true';")


def test_a_chat_streams_the_models_answer_into_the_page(browser, server):
    open_page(browser, f"{server.url}/")
    wait_until(browser, ready, "the playground to load")
    assert text_of(browser, "#model-name") == server.model
    fill(browser, "temperature", "0")
    fill(browser, "max-tokens", "24")
    fill(browser, "extra", '{"ignore_eos": true}')
    fill(browser, "prompt", "Name three rivers.")
    browser.find_element("id", "send").click()
    wait_until(
        browser,
        answer_done,
        "the answer to finish",
    )
    # the page shows what the API answers for the same request
    expected = server.client().chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Name three rivers."}],
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert text_of(browser, f"{ANSWER} .content") == expected.choices[0].message.content
    stats = text_of(browser, f"{ANSWER} .stats")
    assert f"{expected.usage.prompt_tokens} prompt tokens" in stats
    assert "24 completion tokens" in stats and "TTFT" in stats and "tok/s" in stats
    assert "finish: length" in stats
    # the conversation stays in the browser across a reload
    browser.refresh()
    wait_until(browser, ready, "the playground to load again")
    assert browser.execute_script("return document.querySelectorAll('.message').length") == 2
    # structured output (xgrammar is installed): the JSON schema field constrains the answer
    assert browser.find_element("id", "json-schema").is_displayed()
    fill(browser, "json-schema", '{"type": "string", "enum": ["yes", "no"]}')
    fill(browser, "extra", "{}")
    fill(browser, "prompt", "Yes or no?")
    browser.find_element("id", "send").click()
    last = f"{ANSWER}:last-of-type"
    wait_until(
        browser,
        lambda d: answer_done(d, last),
        "the structured answer",
    )
    assert json.loads(text_of(browser, f"{last} .content")) in ("yes", "no")
    assert "finish: stop" in text_of(browser, f"{last} .stats")
    assert browser_errors(browser) == []


def test_stop_aborts_the_request_in_the_engine(browser, long_server):
    server = long_server
    open_page(browser, f"{server.url}/")
    wait_until(browser, ready, "the playground to load")
    before = server.metrics()
    fill(browser, "max-tokens", str(LONG_ANSWER))
    fill(browser, "extra", '{"ignore_eos": true}')
    fill(browser, "system-prompt", "You are a storyteller.")
    fill(browser, "prompt", "Tell me a very long story.")
    browser.execute_script(COUNT_WRITES_AND_FRAMES)
    browser.find_element("id", "send").click()
    # streamed: part of the answer is in the page while the request still runs (some thousand
    # tokens: more than the frames the page draws meanwhile)
    wait_until(browser, lambda d: len(text_of(d, f"{ANSWER} .content")) > 4000, "streamed text")
    assert browser.find_element("id", "stop-button").is_enabled()
    browser.find_element("id", "stop-button").click()
    wait_until(
        browser,
        lambda d: answer_done(d) == "stopped",
        "the answer to stop",
    )
    # a fast stream is drawn once per frame, not once per token: per-token writes of the whole
    # answer grew with it and kept the page from answering WebDriver (a 300 s hang in CI)
    writes, frames = browser.execute_script("return [window.contentWrites, window.frames_];")
    assert 0 < writes <= frames + 1, (writes, frames)
    assert "stopped" in text_of(browser, f"{ANSWER} .stats")
    assert len(text_of(browser, f"{ANSWER} .content")) > 20  # what came before the stop stays
    screenshot(browser, "playground")

    def aborted() -> bool:
        m = server.metrics()
        return (
            metric(m, "baton_request_success_total", finished_reason="abort")
            - metric(before, "baton_request_success_total", finished_reason="abort")
            == 1
        )

    wait_for(aborted, what="the engine to count the abort")
    wait_for(
        lambda: metric(server.metrics(), "baton_num_requests_running") == 0,
        what="the engine to drop the request",
    )
    after = server.metrics()
    generated = metric(after, "baton_generation_tokens_total") - metric(
        before, "baton_generation_tokens_total"
    )
    assert 0 < generated < LONG_ANSWER
    assert metric(after, "baton_request_success_total", finished_reason="length") == metric(
        before, "baton_request_success_total", finished_reason="length"
    )


def test_the_pages_ask_for_the_api_key_and_send_it(browser, keyed_server):
    open_page(browser, f"{keyed_server.url}/")
    enter_key(browser, "not-the-key")
    # refused: asked again, and nothing of the server shown meanwhile
    wait_until(
        browser,
        lambda d: "refused" in text_of(d, "#key-dialog .key-message"),
        "the key to be refused",
    )
    assert text_of(browser, "#model-name") == "" and not ready(browser)
    enter_key(browser, KEY)
    wait_until(browser, ready, "the playground to load with the key")
    assert text_of(browser, "#model-name") == keyed_server.model
    fill(browser, "max-tokens", "8")
    fill(browser, "prompt", "Hi")
    browser.find_element("id", "send").click()
    wait_until(
        browser,
        answer_done,
        "the answer with the key",
    )
    assert "completion tokens" in text_of(browser, f"{ANSWER} .stats")
    assert "Error" not in text_of(browser, f"{ANSWER} .content")
    # the dashboard in the same tab uses the key entered there
    browser.get(f"{keyed_server.url}/dashboard")
    wait_until(
        browser,
        lambda d: text_of(d, "#engine-0 [data-figure=running]") == "0",
        "the dashboard's figures with the key",
    )
    assert browser_errors(browser) == []


def test_the_dashboard_shows_the_queue_grow_and_drain(browser, keyed_server):
    browser.get(f"{keyed_server.url}/dashboard?poll=0.2")  # no load too short to be seen
    wait_until(browser, lambda d: ready(d) or key_asked(d), "the dashboard to load")
    if key_asked(browser):  # run alone: no key entered in this tab yet
        enter_key(browser, KEY)
    wait_until(
        browser,
        lambda d: text_of(d, "#engine-0 [data-figure=running]") == "0",
        "the dashboard's figures",
    )
    generated_before = int(text_of(browser, "#engine-0 [data-figure=generation_tokens]"))
    finished_before = finished(browser)
    body = {
        "model": keyed_server.model,
        "messages": [{"role": "user", "content": "Count to a thousand."}],
        "max_tokens": LOAD_TOKENS,
        "ignore_eos": True,
    }

    def request() -> None:
        r = httpx.post(
            f"{keyed_server.url}/v1/chat/completions",
            json=body,
            timeout=LOAD_TIMEOUT,
            headers={"Authorization": f"Bearer {KEY}"},
        )
        r.raise_for_status()

    load = [threading.Thread(target=request) for _ in range(LOAD_REQUESTS)]
    for t in load:
        t.start()
    try:
        # max_num_seqs = 1: one runs, the others wait, and the page says so
        wait_until(
            browser,
            lambda d: (
                text_of(d, "#engine-0 [data-figure=running]") == "1"
                and int(text_of(d, "#engine-0 [data-figure=waiting]") or 0) >= 1
            ),
            "the queue to grow on the dashboard",
        )
        wait_until(
            browser,
            lambda d: (
                text_of(d, "#engine-0 [data-figure=generation_tokens_per_s]") not in ("–", "0.0")
            ),
            "output tok/s on the dashboard",
        )
        screenshot(browser, "dashboard")
    finally:
        for t in load:
            t.join(LOAD_TIMEOUT)
    wait_until(
        browser,
        lambda d: (
            text_of(d, "#engine-0 [data-figure=running]") == "0"
            and text_of(d, "#engine-0 [data-figure=waiting]") == "0"
            and int(text_of(d, "#engine-0 [data-figure=generation_tokens]"))
            == generated_before + LOAD_REQUESTS * LOAD_TOKENS
        ),
        "the queue to drain on the dashboard",
        timeout=LOAD_TIMEOUT,
    )
    assert "–" not in text_of(browser, "#engine-0 [data-figure=ttft]")
    assert "–" not in text_of(browser, "#engine-0 [data-figure=itl]")
    stop, length, abort, error = finished(browser)
    assert (stop, length - LOAD_REQUESTS, abort, error) == finished_before
    plugins = text_of(browser, "#plugins")
    assert "prometheus" in plugins and "baton-plugin-openai" in plugins
    facts = text_of(browser, "#facts")
    assert "kernel build" in facts and "linear_q" in facts  # baton env's report
    assert browser_errors(browser) == []
