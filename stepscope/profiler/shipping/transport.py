"""POSTs to the collector over one kept-alive HTTP/1.1 connection per sender.

`urllib.request.urlopen` opens a TCP connection per request and runs its handler chain:
~225 µs of the posting thread's CPU on loopback, where a request on an open connection
costs ~60 µs (benchmarks/post_cost.py). The shipper and the watchdog post every second or
two from every rank, on the cores the training uses, so each keeps one `Poster`. The
collector is spared a TCP handshake per request from every rank as well.

Behaviour is urlopen's for the callers: an HTTP status >= 300 raises
`urllib.error.HTTPError` (its `code`, `headers` and `read()`), a failed connection or a
malformed answer an `OSError`. A request on a reused connection that the server closed
while idle (its keep-alive timeout) is sent once more on a new one. Where a proxy applies
to the URL (`http_proxy`, `https_proxy`, `no_proxy`), requests go through urlopen, which
honours it. Stdlib only; one thread per `Poster`.
"""

from __future__ import annotations

import http.client
import io
import ssl
import urllib.error
import urllib.parse
import urllib.request

from stepscope.profiler.config import is_http_url

_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)
"""What a request on a connection the server has closed meanwhile raises."""


class Poster:
    """POSTs to one URL, keeping its connection open between requests."""

    def __init__(self, url: str, *, timeout_s: float) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._invalid = not is_http_url(url)
        """A bad URL is raised by post(), as urlopen did: a sender is built whatever its URL."""
        parts = urllib.parse.urlsplit(url)
        self._port = None if self._invalid else parts.port
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._path = parts.path or "/"
        if parts.query:
            self._path += "?" + parts.query
        proxy = urllib.request.getproxies().get(parts.scheme)
        self._opener = (
            urllib.request.build_opener()  # its ProxyHandler reads the environment now
            if proxy and not urllib.request.proxy_bypass(parts.netloc)
            else None
        )
        self._connection: http.client.HTTPConnection | None = None

    def post(self, body: bytes, headers: dict[str, str]) -> bytes:
        """The answer's body; raises HTTPError for a status >= 300, OSError when unreachable,
        ValueError when the URL is not http(s)."""
        if self._invalid:
            raise ValueError(f"not an http(s) URL: {self.url!r}")
        if self._opener is not None:
            request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
            with self._opener.open(request, timeout=self.timeout_s) as response:
                answer: bytes = response.read()
                return answer
        reused = self._connection is not None
        try:
            return self._send(body, headers)
        except _STALE:
            self.close()
            if not reused:
                raise
        return self._send(body, headers)  # the server had closed the idle connection

    def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    def _send(self, body: bytes, headers: dict[str, str]) -> bytes:
        connection = self._connection
        if connection is None:
            connection = self._connection = self._connect()
        try:
            connection.request("POST", self._path, body=body, headers=headers)
            response = connection.getresponse()
            answer = response.read()
        except http.client.HTTPException as exc:  # a bad status line, a short body
            self.close()
            if isinstance(exc, OSError):  # RemoteDisconnected is both
                raise
            raise ConnectionError(f"bad HTTP answer: {exc!r}") from exc
        except BaseException:
            self.close()
            raise
        if response.will_close:
            self.close()
        if response.status >= 300:  # urlopen does not follow a POST's redirect either
            raise urllib.error.HTTPError(
                self.url, response.status, response.reason, response.headers, io.BytesIO(answer)
            )
        return answer

    def _connect(self) -> http.client.HTTPConnection:
        if self._https:
            context = ssl.create_default_context()
            return http.client.HTTPSConnection(
                self._host, self._port, timeout=self.timeout_s, context=context
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=self.timeout_s)
