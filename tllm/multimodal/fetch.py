"""http(s) image URLs, fetched only from the hosts an operator lists (LlmArgs.allowed_media_domains,
`--allowed-media-domains`): the one place where the server connects to a host a request
names, so it is off unless hosts are listed. A listed entry is a host (https), `https://host`
or `http://host` (that scheme only), with an optional port (default: any). The URL's host must
equal an entry; a name must resolve to public addresses only (private, loopback, link-local
and the like need their IP literal listed), and the connection goes to the address checked
(no second lookup). Redirects are followed to the same host only; the body is counted while
it streams and the whole fetch has one deadline. Refusals are MediaErrors naming the part."""
from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass

import httpx

from tllm.multimodal.media import MediaError

DEFAULT_FETCH_TIMEOUT_S = 5.0
DEFAULT_MAX_FETCH_BYTES = 16 << 20    # the server's --max-body-bytes default
MAX_REDIRECTS = 3
_DEFAULT_PORTS = {"http": 80, "https": 443}
_IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class AllowedHost:
    """One allow-list entry: a lower-case host name or IP literal, its scheme, its port."""
    host: str
    scheme: str
    port: int | None    # None: any port

    def admits(self, url: httpx.URL) -> bool:
        return (url.host == self.host and url.scheme == self.scheme
                and self.port in (None, effective_port(url)))


def parse_allowed_host(entry: str) -> AllowedHost:
    """`host`, `host:port`, `https://host[:port]` or `http://host[:port]`; ValueError else."""
    text = entry.strip()
    refusal = ValueError(f"allowed_media_domains: {entry!r} is not a host, host:port, "
                         "https://host or http://host (an IPv6 address in brackets)")
    try:
        url = httpx.URL(text if "://" in text else f"https://{text}")
    except httpx.InvalidURL:
        raise refusal from None
    if url.scheme not in _DEFAULT_PORTS or not url.host or url.raw_path not in (b"", b"/") \
            or url.query or url.userinfo:
        raise refusal
    return AllowedHost(url.host, url.scheme, url.port and effective_port(url))


def effective_port(url: httpx.URL) -> int:
    return url.port or _DEFAULT_PORTS[url.scheme]


def ip_literal(host: str) -> _IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def is_public(address: _IPAddress) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


@dataclass(frozen=True)
class HttpImageFetcher:
    """Fetches an image URL's bytes within the allow-list and the limits; blocking (the
    server calls it off its event loop)."""
    allowed: tuple[AllowedHost, ...]
    timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    max_bytes: int = DEFAULT_MAX_FETCH_BYTES

    def fetch(self, url: str, param: str) -> bytes:
        deadline = time.monotonic() + self.timeout_s
        target = self._check_url(url, param)
        try:
            with httpx.Client(timeout=self.timeout_s, follow_redirects=False,
                              trust_env=False) as client:
                for _ in range(MAX_REDIRECTS + 1):
                    body, location = self._get(client, target, param, deadline)
                    if body is not None:
                        return body
                    target = self._check_redirect(target, location, param)
        except httpx.TimeoutException:
            raise MediaError(f"fetching the image timed out ({self.timeout_s:g} s)",
                             param) from None
        except httpx.HTTPError as exc:
            raise MediaError(f"fetching the image failed: {type(exc).__name__}",
                             param) from None
        raise MediaError(f"the image URL redirected more than {MAX_REDIRECTS} times", param)

    def _check_url(self, url: str, param: str) -> httpx.URL:
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL:
            raise MediaError("the image URL is malformed", param) from None
        if not any(entry.admits(parsed) for entry in self.allowed):
            raise MediaError(f"the image URL's host {parsed.host!r} ({parsed.scheme}, port "
                             f"{effective_port(parsed)}) is not in --allowed-media-domains",
                             param)
        return parsed

    def _check_redirect(self, source: httpx.URL, location: str, param: str) -> httpx.URL:
        try:
            target = source.join(location)
        except httpx.InvalidURL:
            raise MediaError("the image URL redirected to a malformed URL", param) from None
        if target.host != source.host:
            raise MediaError(f"the image URL redirected to another host ({target.host!r}); "
                             "only redirects within the same host are followed", param)
        return self._check_url(str(target), param)

    def _get(self, client: httpx.Client, url: httpx.URL, param: str,
             deadline: float) -> tuple[bytes | None, str | None]:
        """(the body, None) for a 200, (None, the Location) for a redirect."""
        request = self._pinned_request(client, url, param, deadline)
        response = client.send(request, stream=True)
        try:
            if response.is_redirect:
                return None, response.headers["location"]
            if response.status_code != 200:
                raise MediaError(f"the image URL answered HTTP {response.status_code}", param)
            return self._read_body(response, param, deadline), None
        finally:
            response.close()

    def _pinned_request(self, client: httpx.Client, url: httpx.URL, param: str,
                        deadline: float) -> httpx.Request:
        """A GET to the checked address itself: a name resolved here is not looked up
        again (a second answer could be a private address), TLS still checks the name.
        Its connect and read timeouts are what is left of the fetch's deadline."""
        address = ip_literal(url.host) or self._resolve(url, param)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise httpx.ConnectTimeout("the fetch's deadline passed")
        headers = {"Host": url.netloc.decode("ascii"), "Accept": "image/*",
                   "Accept-Encoding": "identity"}   # counted bytes are the image's bytes
        return client.build_request("GET", url.copy_with(host=str(address)), headers=headers,
                                    timeout=remaining, extensions={"sni_hostname": url.host})

    def _resolve(self, url: httpx.URL, param: str) -> _IPAddress:
        try:
            infos = socket.getaddrinfo(url.host, effective_port(url), type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            raise MediaError(f"cannot resolve the image URL's host {url.host!r}",
                             param) from None
        addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
        listed = {entry.host for entry in self.allowed}
        for address in addresses:
            if not is_public(address) and str(address) not in listed:
                raise MediaError(f"the image URL's host {url.host!r} resolves to a "
                                 f"non-public address ({address}); list that address in "
                                 "--allowed-media-domains to allow it", param)
        return addresses[0]

    def _read_body(self, response: httpx.Response, param: str, deadline: float) -> bytes:
        too_large = MediaError(f"the image is larger than {self.max_bytes:,} bytes", param)
        length = response.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            raise too_large
        body = bytearray()
        for chunk in response.iter_raw():
            body += chunk
            if len(body) > self.max_bytes:
                raise too_large
            if time.monotonic() > deadline:
                raise httpx.ReadTimeout("the fetch's deadline passed")
        return bytes(body)


def media_fetcher(allowed_domains: list[str] | None,
                  timeout_s: float = DEFAULT_FETCH_TIMEOUT_S,
                  max_bytes: int = DEFAULT_MAX_FETCH_BYTES) -> HttpImageFetcher | None:
    """The fetcher an engine's settings ask for; None (http(s) refused) without hosts."""
    if not allowed_domains:
        return None
    return HttpImageFetcher(tuple(parse_allowed_host(entry) for entry in allowed_domains),
                            timeout_s, max_bytes)
