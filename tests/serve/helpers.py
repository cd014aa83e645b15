"""Assertions shared by the server tests."""
from __future__ import annotations

import time

import httpx


def wait_until_idle(llm, timeout_s: float = 2.0) -> float:
    """Seconds until nothing runs or waits and every KV block is free; fails after timeout_s."""
    start = time.monotonic()
    while True:
        stats = llm.get_stats()
        if (stats["kv_blocks_free"] == stats["kv_blocks_total"]
                and stats["num_running"] == 0 and stats["num_waiting"] == 0):
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"engine not idle after {timeout_s} s: {stats}")
        time.sleep(0.01)


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    """The response has the status and OpenAI's error body; returns the error object."""
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error
