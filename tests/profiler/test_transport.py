"""The kept-alive POST client of the shipper and the watchdog, against real loopback servers."""

from __future__ import annotations

import socket
import threading
import urllib.error
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from stepscope.profiler.shipping.transport import Poster
from tests.live_server import RunningServer


@dataclass
class Server:
    url: str
    connections: int = 0
    requests: list[tuple[str, bytes]] = field(default_factory=list)
    """(request path as sent, body) of every request."""
    status: int = 200
    close_after_answer: bool = False
    """Close each connection after one answer that promised keep-alive (an idle timeout)."""


@contextmanager
def server(protocol: str = "HTTP/1.1") -> Iterator[Server]:
    state = Server(url="")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = protocol
        disable_nagle_algorithm = True

        def setup(self) -> None:
            super().setup()
            state.connections += 1

        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            state.requests.append((self.path, body))
            answer = b'{"ok":true}' if state.status < 300 else b'{"detail":"no"}'
            self.send_response(state.status)
            self.send_header("Content-Length", str(len(answer)))
            self.send_header("Retry-After", "7")
            self.end_headers()
            self.wfile.write(answer)
            if state.close_after_answer:
                self.close_connection = True

        def log_message(self, format: str, *args: object) -> None:
            return

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}/v1/ingest"
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()


HEADERS = {"Content-Type": "application/json"}


def test_requests_share_one_connection() -> None:
    with server() as srv:
        poster = Poster(srv.url, timeout_s=5.0)
        answers = [poster.post(f'{{"n":{n}}}'.encode(), HEADERS) for n in range(3)]
        poster.close()
    assert answers == [b'{"ok":true}'] * 3
    assert srv.requests == [("/v1/ingest", f'{{"n":{n}}}'.encode()) for n in range(3)]
    assert srv.connections == 1


def test_a_connection_the_server_closed_is_replaced_and_the_body_sent_once() -> None:
    with server() as srv:
        srv.close_after_answer = True
        poster = Poster(srv.url, timeout_s=5.0)
        for n in range(3):
            assert poster.post(f'{{"n":{n}}}'.encode(), HEADERS) == b'{"ok":true}'
    assert [body for _, body in srv.requests] == [b'{"n":0}', b'{"n":1}', b'{"n":2}']
    assert srv.connections == 3


def test_an_http_1_0_server_gets_a_connection_per_request() -> None:
    with server("HTTP/1.0") as srv:
        poster = Poster(srv.url, timeout_s=5.0)
        for _ in range(2):
            assert poster.post(b"{}", HEADERS) == b'{"ok":true}'
    assert srv.connections == 2


@pytest.mark.parametrize("status", [307, 429, 503])
def test_a_status_of_300_or_more_raises_urllibs_http_error(status: int) -> None:
    with server() as srv:
        srv.status = status
        poster = Poster(srv.url, timeout_s=5.0)
        with pytest.raises(urllib.error.HTTPError) as caught:
            poster.post(b"{}", HEADERS)
        srv.status = 200
        assert poster.post(b"{}", HEADERS) == b'{"ok":true}'  # the connection stays usable
    assert caught.value.code == status
    assert caught.value.headers["Retry-After"] == "7"
    assert caught.value.read() == b'{"detail":"no"}'


def test_an_unreachable_collector_raises_oserror() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: refused
        poster = Poster(f"http://127.0.0.1:{port}/v1/ingest", timeout_s=2.0)
        with pytest.raises(ConnectionRefusedError):
            poster.post(b"{}", HEADERS)


@pytest.mark.parametrize("url", ["collector:8000/v1/hangs", "http://collector:port/v1/hangs"])
def test_a_url_that_is_not_http_fails_at_each_post_not_before(url: str) -> None:
    poster = Poster(url, timeout_s=1.0)
    with pytest.raises(ValueError, match="not an http"):
        poster.post(b"{}", HEADERS)


def test_a_malformed_answer_raises_oserror() -> None:
    listener = socket.create_server(("127.0.0.1", 0))

    def answer_garbage() -> None:
        connection, _ = listener.accept()
        connection.recv(65536)
        connection.sendall(b"not http at all\r\n\r\n")
        connection.close()

    thread = threading.Thread(target=answer_garbage, daemon=True)
    thread.start()
    poster = Poster(f"http://127.0.0.1:{listener.getsockname()[1]}/", timeout_s=5.0)
    with pytest.raises(OSError, match="bad HTTP answer"):
        poster.post(b"{}", HEADERS)
    thread.join(5.0)
    listener.close()


def test_a_proxy_in_the_environment_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    with server() as proxy:
        monkeypatch.setenv("http_proxy", proxy.url.removesuffix("/v1/ingest"))
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.delenv("NO_PROXY", raising=False)
        poster = Poster("http://collector.example:8000/v1/ingest", timeout_s=5.0)
        assert poster.post(b'{"via":"proxy"}', HEADERS) == b'{"ok":true}'
    assert proxy.requests == [("http://collector.example:8000/v1/ingest", b'{"via":"proxy"}')]


def test_the_real_collector_keeps_the_connection(live_server: RunningServer) -> None:
    poster = Poster(f"{live_server.url}/v1/hangs", timeout_s=10.0)
    with pytest.raises(urllib.error.HTTPError) as caught:
        poster.post(b"{}", HEADERS)  # not a report: 422, and the connection stays open
    assert caught.value.code == 422
    assert poster._connection is not None
    local = poster._connection.sock.getsockname()
    with pytest.raises(urllib.error.HTTPError):
        poster.post(b"[]", HEADERS)
    assert poster._connection.sock.getsockname() == local
    poster.close()
