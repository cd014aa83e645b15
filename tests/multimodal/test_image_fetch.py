"""http(s) image URLs (tllm.multimodal.fetch) against a local server on 127.0.0.1: refused
when fetching is off and for hosts, schemes and ports not listed; fetched from a listed IP
literal; redirects followed within the host only; oversized bodies and slow hosts refused
before anything is decoded. Nothing here reaches the internet."""
from __future__ import annotations

import numpy as np
import pytest

from tests.multimodal.image_host import PNG_IMAGE, ImageHost
from tllm.multimodal.chat import remote_image_urls, split_chat_images
from tllm.multimodal.fetch import media_fetcher, parse_allowed_host
from tllm.multimodal.media import MediaError, load_image_url

LIMIT = 1 << 16


@pytest.fixture(scope="module")
def image_host():
    with ImageHost(oversized_bytes=LIMIT) as host:
        yield host


def fetcher(*domains: str, timeout_s: float = 5.0):
    return media_fetcher(list(domains), timeout_s=timeout_s, max_bytes=LIMIT)


def refusal(url: str, fetch=None) -> str:
    with pytest.raises(MediaError) as info:
        load_image_url(url, "messages.0.content.1", fetch=fetch)
    assert info.value.param == "messages.0.content.1"
    return str(info.value)


def test_refused_when_off(image_host):
    before = len(image_host.hits)
    assert "not fetched" in refusal(image_host.url("/image.png"))
    assert media_fetcher(None) is None and media_fetcher([]) is None
    assert len(image_host.hits) == before   # no connection was made


@pytest.mark.parametrize("domains", [
    ["example.org"],                  # another host
    ["127.0.0.1"],                    # https only: the URL is http
    ["http://127.0.0.1:1"],           # another port
    ["https://127.0.0.1"],
])
def test_refused_for_unlisted_host_scheme_or_port(image_host, domains):
    before = len(image_host.hits)
    message = refusal(image_host.url("/image.png"), fetcher(*domains).fetch)
    assert "not in --allowed-media-domains" in message
    assert len(image_host.hits) == before


def test_listed_name_resolving_to_loopback_is_refused(image_host):
    before = len(image_host.hits)
    message = refusal(image_host.url("/image.png", host="localhost"),
                      fetcher("http://localhost").fetch)
    assert "non-public address" in message
    assert len(image_host.hits) == before


@pytest.mark.parametrize("path", ["/image.png", "/redirect-here"])
def test_fetched_from_a_listed_ip_literal(image_host, path):
    image = load_image_url(image_host.url(path), "p",
                           fetch=fetcher("http://127.0.0.1").fetch)
    assert np.array_equal(np.asarray(image), np.asarray(PNG_IMAGE))


def test_listed_port_admits_that_port_only(image_host):
    fetch = fetcher(f"http://127.0.0.1:{image_host.port}").fetch
    assert load_image_url(image_host.url("/image.png"), "p", fetch=fetch).size == (56, 42)


def test_ipv6_loopback_needs_its_own_entry(image_host):
    assert "not in --allowed-media-domains" in refusal(
        f"http://[::1]:{image_host.port}/image.png", fetcher("http://127.0.0.1").fetch)
    assert parse_allowed_host("http://[::1]:8080").host == "::1"


def test_redirect_to_another_host_is_refused(image_host):
    message = refusal(image_host.url("/redirect-away"),
                      fetcher("http://127.0.0.1", "http://localhost").fetch)
    assert "redirected to another host ('localhost')" in message
    assert image_host.hits[-1] == "/redirect-away"   # localhost was never asked


@pytest.mark.parametrize("path", ["/huge", "/huge-declared"])
def test_oversized_body_refused_before_decoding(image_host, path, monkeypatch):
    import tllm.multimodal.media as media
    monkeypatch.setattr(media, "decode_image_bytes", pytest.fail)   # never reached
    message = refusal(image_host.url(path), fetcher("http://127.0.0.1").fetch)
    assert f"larger than {LIMIT:,} bytes" in message


def test_slow_host_times_out(image_host):
    message = refusal(image_host.url("/slow"),
                      fetcher("http://127.0.0.1", timeout_s=0.2).fetch)
    image_host.release.set()
    assert "timed out (0.2 s)" in message


def test_chat_parts_fetch_names_the_part(image_host):
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": image_host.url("/image.png")}},
        {"type": "image_url", "image_url": {"url": image_host.url("/redirect-away")}}]}]
    assert list(remote_image_urls(messages)) == ["messages.0.content.1",
                                                 "messages.0.content.2"]
    assert list(remote_image_urls(messages, max_images=1)) == ["messages.0.content.1"]
    with pytest.raises(MediaError) as info:
        split_chat_images(messages, fetch=fetcher("http://127.0.0.1").fetch)
    assert info.value.param == "messages.0.content.2"


@pytest.mark.parametrize("entry", ["ftp://host", "https://host/path", "https://u@host",
                                   "https://host?x=1", "", "::1"])
def test_bad_allow_list_entries_are_refused(entry):
    from tllm.config import LlmArgs
    with pytest.raises(ValueError):
        parse_allowed_host(entry)
    with pytest.raises(ValueError):
        LlmArgs(model="x", allowed_media_domains=[entry])
