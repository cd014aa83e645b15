"""Makes docs/dashboard.png: `tllm serve smollm2` on a loopback port, 10 chat clients for
about a minute, and Debian's headless Chromium (through playwright) on /dashboard.
Run from the repository root: .venv/bin/python docs/make_dashboard_screenshot.py"""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
from playwright.sync_api import sync_playwright

PORT = 18731
BASE = f"http://127.0.0.1:{PORT}"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
TOPICS = ["the sea", "a city at night", "trains", "mountains", "coffee", "rain", "a library",
          "bees"]
NUM_CLIENTS, LOAD_S = 10, 75


def wait_for_server(proc: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{BASE}/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    sys.exit("the server did not start")


def client(index: int, stop: float) -> None:
    with httpx.Client(base_url=BASE, timeout=120) as http:
        while time.monotonic() < stop:
            http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Write a short poem about "
                              f"{TOPICS[index % len(TOPICS)]}."}],
                "max_tokens": 96, "temperature": 0.7})


def main() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "tllm.cli", "serve", "smollm2", "--port",
                             str(PORT), "--max-seq-len", "1024", "--max-batch-size", "16"])
    try:
        wait_for_server(proc)
        stop = time.monotonic() + LOAD_S
        clients = [threading.Thread(target=client, args=(i, stop)) for i in range(NUM_CLIENTS)]
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path="/usr/bin/chromium",
                                                 args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 820})
            page.goto(f"{BASE}/dashboard")
            for thread in clients:
                thread.start()
                time.sleep(0.5)
            time.sleep(LOAD_S - 20)
            page.screenshot(path="docs/dashboard.png")
            browser.close()
        for thread in clients:
            thread.join()
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
