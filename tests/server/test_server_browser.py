"""GET / in a real headless browser (Debian's chromium driven by Playwright): the page a
teacher projects must show what the pool holds while requests come in.

Playwright's expect() retries until the page, which redraws itself every 0.5 s, shows the
expected text. Chromium is told to resolve no host but 127.0.0.1, so nothing leaves the machine.
"""

import os
import shutil

import pytest

from engine import Engine
from engine.one_request import run_request
from engine.request import SamplingParams
from helpers import SYSTEM, assert_pool_whole, call, serve
from server import create_app

sync_api = pytest.importorskip("playwright.sync_api")

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1, EXCLUDE localhost",
]


@pytest.fixture
def page():
    if not shutil.which(CHROMIUM):
        message = "no chromium here: `bash setup.sh` as root installs it (apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI installs it: a missing browser there is a broken setup, not a skip
        pytest.skip(message)
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        yield browser.new_page(viewport={"width": 1280, "height": 900})
        browser.close()


def test_the_page_shows_the_pool_live(page, tiny_model, tokenizer, tmp_path):
    expect = sync_api.expect
    expect.set_options(timeout=15_000)
    engine = Engine(model=tiny_model, tokenizer=tokenizer, block_size=4, num_blocks=48)
    with serve(create_app(engine, model_name="tiny-llama")) as url:
        page.goto(url + "/")
        expect(page.locator("#status")).to_have_text("live, every 0.5 s")
        expect(page.locator("#model")).to_have_text("tiny-llama · 48 blocks of 4 tokens")
        expect(page.locator("#pool .block.empty")).to_have_count(48)
        expect(page.locator("#hit-rate")).to_have_text("0.0%")

        # Two requests sharing a system prompt: the second hits the first one's blocks.
        for question in ("What is a block?", "What is a hash?"):
            assert call(url, "/generate", {"prompt": SYSTEM + question, "max_tokens": 4})[0] == 200
        health = call(url, "/health")[1]
        assert health["hit_tokens"] > 0
        expect(page.locator("#hit-tokens")).to_have_text(f"{health['hit_tokens']} / {health['queried_tokens']}")
        expect(page.locator("#hit-rate")).to_have_text(f"{100 * health['hit_rate']:.1f}%")
        expect(page.locator("#cached")).to_have_text(str(health["num_cached_blocks"]))
        expect(page.locator("#pool .block.cached")).to_have_count(health["num_cached_blocks"])
        first_block = engine.allocator.blocks[min(b for b in range(48) if engine.allocator.block_hash(b))]
        expect(page.locator("#cached-blocks tr").first).to_contain_text(tokenizer.decode(first_block.token_ids))

        # A running request: its block table appears, green, and its blocks leave the free queue.
        # Stage 7's path holds it still between two tokens (the engine loop would decode on).
        held = run_request(engine.parts, "student-1", engine.tokenize(SYSTEM + "Go on."), SamplingParams(max_tokens=8),
                           None, 0.0)
        next(held)
        table = engine.allocator.block_tables["student-1"]
        row = page.locator('#tables .request[data-request="student-1"]')
        expect(row.locator(".block.in-use")).to_have_text([str(b) for b in table])
        expect(page.locator("#running")).to_have_text("1")
        expect(page.locator("#queue-title")).to_contain_text(f"free queue: {48 - len(table)} blocks")
        # PAGE_SCREENSHOT=assets/server_page.png makes the picture docs/server.md shows.
        page.screenshot(path=os.environ.get("PAGE_SCREENSHOT") or tmp_path / "pool.png", full_page=True)

        held.close()
        expect(page.locator("#tables")).to_have_text("none: the pool is idle")
        expect(page.locator("#pool .block.in-use")).to_have_count(0)
    assert_pool_whole(engine)


def test_the_page_keeps_the_key_of_its_address_for_its_polls_and_drops_it_from_the_address_bar(
        page, tiny_model, tokenizer):
    expect = sync_api.expect
    expect.set_options(timeout=15_000)
    engine = Engine(model=tiny_model, tokenizer=tokenizer, block_size=4, num_blocks=48)
    app = create_app(engine, model_name="tiny-llama", salt_by_api_key=True, admin_key="s3cret")
    sent = []  # the Authorization header of every /cache poll
    page.on("request", lambda r: r.url.endswith("/cache") and sent.append(r.headers.get("authorization")))
    with serve(app) as url:
        page.goto(url + "/#key=s3cret")
        expect(page.locator("#status")).to_have_text("live, every 0.5 s")  # /cache answers only with a key
        expect(page).to_have_url(url + "/")  # the key left the address bar: its entry replaced, not added
        page.reload()  # the same tab: the key is kept for it, in sessionStorage
        expect(page.locator("#status")).to_have_text("live, every 0.5 s")
        assert sent and set(sent) == {"Bearer s3cret"}

        page.goto(url + "/#key=")  # an empty key forgets it (a new fragment only: the page is not reloaded)
        expect(page).to_have_url(url + "/")
        expect(page.locator("#status")).to_contain_text("open this page as /#key=YOUR-KEY")
        page.goto(url + "/#key=s3cret")  # typed after the address of the open page
        expect(page).to_have_url(url + "/")
        expect(page.locator("#status")).to_have_text("live, every 0.5 s")
    assert_pool_whole(engine)
