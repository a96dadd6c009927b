"""TLS of the HTTP port from the public port's certificate files, renewed without a restart.

``server_context(tls)`` is an ``ssl.SSLContext`` for the server side. Like the gRPC port's
credentials (``common.tls.ServerTLS``), it follows the files: at each new connection's
handshake (the context's SNI callback, which runs for every ClientHello, with or without a
server name) the files' identity is compared with the one last loaded, at most once per
``RECHECK_S``; when they changed, a fresh context is loaded and the connection switched to it,
and later connections start from it. Established connections keep their certificate. A renewal
that cannot be used (half-written, key and certificate that do not match) keeps the previous
certificate and is logged.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time

from common.tls import ServerTLS, check_key_pair, file_stamps

log = logging.getLogger(__name__)
RECHECK_S = 1.0


class _Reloader:
    def __init__(self, tls: ServerTLS) -> None:
        self.tls = tls
        self.files = (tls.cert_file, tls.key_file)
        self.lock = threading.Lock()
        self.stamp = file_stamps(self.files)
        self.checked_at = time.monotonic()
        self.current = self.load()

    def load(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.tls.cert_file, self.tls.key_file)
        context.sni_callback = self.on_hello
        return context

    def on_hello(self, sslobj, server_name, context) -> None:
        latest = self.latest()
        if latest is not context:
            sslobj.context = latest

    def latest(self) -> ssl.SSLContext:
        now = time.monotonic()
        with self.lock:
            if now - self.checked_at < RECHECK_S:
                return self.current
            self.checked_at = now
            stamp = file_stamps(self.files)
            if stamp == self.stamp:
                return self.current
            self.stamp = stamp
            try:
                check_key_pair(*self.files)
                self.current = self.load()
                log.info("TLS certificate %s reloaded (HTTP port)", self.tls.cert_file)
            except (ValueError, OSError, ssl.SSLError) as exc:
                log.warning("TLS files changed but cannot be used (%s); serving the old ones", exc)
            return self.current


def server_context(tls: ServerTLS) -> ssl.SSLContext:
    """The HTTP port's TLS context (see the module docstring)."""
    return _Reloader(tls).current
