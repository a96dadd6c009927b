"""http(s) download of an image or a video: a timeout, a size cap, no private addresses by
default.

NOTE: the host is resolved once and every resolved address is checked; a DNS answer that changes
between our check and urllib's own lookup (rebinding) is not defended against. Redirects are
refused, since their target would bypass the address check.
"""

from __future__ import annotations

import ipaddress
import socket
import urllib.error
import urllib.parse
import urllib.request

from .errors import InvalidInput


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: D102
        raise InvalidInput(f"URL redirects ({code}) are not followed")


def check_url(url: str, allow_private: bool) -> None:
    """Raise ``InvalidInput`` unless ``url`` is http(s) to an allowed address."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidInput(f"unsupported URL {url[:200]!r} (http or https only)")
    if allow_private:
        return
    try:
        infos = socket.getaddrinfo(parts.hostname, parts.port or 80, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise InvalidInput(f"cannot resolve {parts.hostname!r}: {exc}") from None
    for info in infos:
        addr = ipaddress.ip_address(info[4][0])
        if not addr.is_global:
            raise InvalidInput(
                f"URL host {parts.hostname!r} resolves to a non-public address ({addr})"
            )


def fetch_url(url: str, max_bytes: int, timeout_s: float, allow_private: bool) -> bytes:
    check_url(url, allow_private)
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(url, timeout=timeout_s) as resp:
            length = resp.headers.get("Content-Length")
            if length and length.isdigit() and int(length) > max_bytes:
                raise InvalidInput(f"URL body is {length} bytes; the limit is {max_bytes}")
            data = resp.read(max_bytes + 1)
    except InvalidInput:
        raise
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise InvalidInput(f"cannot fetch URL: {exc}") from None
    if len(data) > max_bytes:
        raise InvalidInput(f"URL body exceeds the limit of {max_bytes} bytes")
    return data
