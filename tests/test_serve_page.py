"""The chat page at / in a real headless browser (Debian's chromium + chromium-driver through
selenium; nothing downloads a browser): a message streams a reply, with TTFT and tokens/s."""

import os
import re
import shutil

import pytest
from serve_util import Server

webdriver = pytest.importorskip("selenium.webdriver")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
MISSING = "needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"
if not (CHROMIUM and DRIVER) and os.environ.get("CI"):
    raise RuntimeError(f"CI must run the chat page test: {MISSING}; .ci/run installs them")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason=MISSING)


@pytest.fixture(scope="module")
def server(tiny_model_file, tmp_path_factory):
    with Server(tiny_model_file, tmp_path_factory.mktemp("serve"), "--max-context", "1024") as s:
        yield s


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # selenium must not try to fetch a browser or a driver
    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium')}",
    ):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def test_page_streams_a_reply(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server.url + "/")
    wait = WebDriverWait(browser, 30)
    wait.until(lambda d: d.find_element(By.ID, "model").text == "tiny")
    for field, value in (("temperature", "0.7"), ("max_tokens", "24")):  # a random model's greedy text is blank
        el = browser.find_element(By.ID, field)
        el.clear()
        el.send_keys(value)
    # Watch the reply grow: a streamed reply shows more than one distinct partial text.
    browser.execute_script("""
        window.partials = new Set();
        new MutationObserver(() => { const m = document.querySelector('.assistant');
                                      if (m) window.partials.add(m.textContent); })
            .observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});""")
    browser.find_element(By.ID, "prompt").send_keys("Tell me a story about caches")
    browser.find_element(By.ID, "send").click()
    stats = wait.until(
        lambda d: d.find_element(By.ID, "stats-1") if d.find_element(By.ID, "stats-1").get_attribute("data-done") else None
    )
    reply = browser.find_element(By.CSS_SELECTOR, ".assistant").text
    print("reply:", repr(reply), "|", stats.text)
    assert reply and "TTFT" in stats.text and "tokens/s" in stats.text
    assert float(stats.get_attribute("data-ttft-ms")) > 0
    assert float(stats.get_attribute("data-tokens-per-s")) > 0
    assert len(browser.execute_script("return Array.from(window.partials)")) > 2  # it arrived in pieces
    # max_tokens reached, or an end-of-sequence token drawn earlier (temperature 0.7 samples one now and then)
    m = re.search(r"(\d+) tokens · .* · (\w+)$", stats.text)
    assert m, stats.text
    n, finish = int(m.group(1)), m.group(2)
    assert (n == 24 and finish == "length") or (0 < n < 24 and finish == "stop"), stats.text

    # a second turn: the conversation is sent again and the server reuses its prefix
    browser.find_element(By.ID, "prompt").send_keys("And then?")
    browser.find_element(By.ID, "send").click()
    stats2 = wait.until(
        lambda d: d.find_element(By.ID, "stats-3") if d.find_element(By.ID, "stats-3").get_attribute("data-done") else None
    )
    print("turn 2:", stats2.text)
    assert "cached" in stats2.text and "(0 cached)" not in stats2.text
