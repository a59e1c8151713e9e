"""`stepscope run`'s node relay: the node's ranks post their batches to it on loopback, and it
sends those that arrive together to the collector in one request (a bundle), so that the
collector handles one request per node and flush instead of one per rank.

Nothing is acknowledged before the collector answered: each rank gets the collector's own
answer for its batch, or the collector's error for the whole request, so delivery stays
exactly-once by (rank, incarnation, seq) as without the relay. The relay holds no batch of
its own; a rank whose request fails resends it as it would to the collector. The ranks flush
at the same moments (Shipper: one slot per node and interval), so a short window catches
them all. Standard library only.
"""

from __future__ import annotations

import gzip
import json
import logging
import threading
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)

INGEST_PATH = "/v1/ingest"
_REFUSED_FOR_ANY_BATCH = (401, 403, 408, 429)
"""Refusals of a bundle that each of its batches would get alone (the token, the load)."""


@dataclass(frozen=True, slots=True)
class Answer:
    """What a rank is told: the HTTP status, body and Retry-After of its batch."""

    status: int
    body: bytes
    retry_after: str | None = None


@dataclass(slots=True)
class RelayStats:
    num_batches: int = 0
    """Batches the ranks posted."""
    num_requests: int = 0
    """Requests sent to the collector (bundles, and batches passed on alone)."""


class _BundleRefused(Exception):
    """The collector refused a bundle as a whole for what its batches hold (e.g. 413)."""


@dataclass(slots=True)
class _Bundle:
    authorization: str | None
    documents: list[bytes] = field(default_factory=list)
    num_bytes: int = 0
    full: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    answers: list[Answer] = field(default_factory=list)


class NodeRelay:
    """An HTTP server on 127.0.0.1 that bundles the ranks' `POST /v1/ingest` requests."""

    def __init__(
        self,
        url: str,
        *,
        window_s: float = 0.2,
        max_bundle_bytes: int = 8 * 1024 * 1024,
        max_bundle_batches: int = 256,
        timeout_s: float = 8.0,
    ) -> None:
        self._upstream = url.rstrip("/") + INGEST_PATH
        self._window_s = window_s
        self._max_bundle_bytes = max_bundle_bytes
        """Most JSON bytes in one bundle (the collector's default body limit is 64 MiB)."""
        self._max_bundle_batches = max_bundle_batches
        self._timeout_s = timeout_s
        """Of one request to the collector; shorter than a rank's own (10 s), so that a rank
        hears the relay's 502 before it gives up on the relay."""
        self._lock = threading.Lock()
        self._open: dict[str | None, _Bundle] = {}
        self.stats = RelayStats()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="stepscope-node-relay", daemon=True
        )

    @property
    def url(self) -> str:
        """Where the ranks post (STEPSCOPE_RELAY_URL)."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop taking requests; bundles being sent finish in their own threads."""
        self._server.shutdown()
        self._server.server_close()

    def relay(
        self, body: bytes, *, content_encoding: str | None, authorization: str | None
    ) -> Answer:
        """The collector's answer for one rank's batch (called in the rank's request thread)."""
        with self._lock:
            self.stats.num_batches += 1
        document = _json_document(body, content_encoding, self._max_bundle_bytes)
        if document is None:  # not what the relay can bundle: the collector says what is wrong
            return self._post(body, content_encoding, authorization, 1)[0]
        with self._lock:
            bundle = self._open.get(authorization)
            leader = bundle is None
            if bundle is None:
                bundle = self._open[authorization] = _Bundle(authorization)
            index = len(bundle.documents)
            bundle.documents.append(document)
            bundle.num_bytes += len(document)
            if (
                bundle.num_bytes >= self._max_bundle_bytes
                or len(bundle.documents) >= self._max_bundle_batches
            ):
                del self._open[authorization]
                bundle.full.set()
        if leader:
            bundle.full.wait(self._window_s)
            with self._lock:
                if self._open.get(authorization) is bundle:
                    del self._open[authorization]
            self._send(bundle)
        else:
            bundle.done.wait()
        return bundle.answers[index]

    def _send(self, bundle: _Bundle) -> None:
        auth = bundle.authorization
        try:
            try:
                bundle.answers = self._post(
                    bundle_body(bundle.documents), "gzip", auth, len(bundle.documents), bundle=True
                )
            except _BundleRefused:  # no batch may fail for sharing a request: each goes alone
                bundle.answers = [
                    self._post(gzip.compress(document), "gzip", auth, 1)[0]
                    for document in bundle.documents
                ]
        except Exception as exc:  # a relay bug must not leave its ranks waiting
            log.exception("stepscope node relay could not send a bundle")
            bundle.answers = [_unreachable(exc)] * len(bundle.documents)
        finally:
            bundle.done.set()

    def _post(
        self,
        body: bytes,
        content_encoding: str | None,
        authorization: str | None,
        num_batches: int,
        *,
        bundle: bool = False,
    ) -> list[Answer]:
        """One request to the collector; an answer per batch it carried."""
        headers = {"Content-Type": "application/json"}
        if content_encoding:
            headers["Content-Encoding"] = content_encoding
        if authorization:
            headers["Authorization"] = authorization
        request = urllib.request.Request(self._upstream, data=body, headers=headers, method="POST")
        with self._lock:
            self.stats.num_requests += 1
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as response:
                answer = response.read()
        except urllib.error.HTTPError as exc:  # the request as a whole: each batch is told
            refused_for_content = 400 <= exc.code < 500 and exc.code not in _REFUSED_FOR_ANY_BATCH
            if bundle and num_batches > 1 and refused_for_content:
                raise _BundleRefused(exc.code) from exc
            failed = Answer(exc.code, exc.read(), exc.headers.get("Retry-After"))
            return [failed] * num_batches
        except (OSError, ValueError) as exc:
            return [_unreachable(exc)] * num_batches
        if not bundle:
            return [Answer(200, answer)]
        return _bundle_answers(answer, num_batches)


def bundle_body(documents: list[bytes]) -> bytes:
    """The gzipped request body of a bundle of batches (each one's JSON text)."""
    return gzip.compress(b'{"batches":[' + b",".join(documents) + b"]}", compresslevel=6)


def _bundle_answers(answer: bytes, num_batches: int) -> list[Answer]:
    """Each batch's answer from the collector's `{"results": [...]}`, in order."""
    try:
        results = json.loads(answer)["results"]
        if len(results) != num_batches:
            raise ValueError(f"{len(results)} results for {num_batches} batches")
        return [
            Answer(
                result.pop("status"),
                json.dumps(result, separators=(",", ":")).encode(),
            )
            for result in results
        ]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return [_unreachable(ValueError(f"unexpected answer from the collector: {exc}"))] * (
            num_batches
        )


def _unreachable(exc: BaseException) -> Answer:
    detail = f"stepscope node relay: collector unreachable ({type(exc).__name__}: {exc})"
    return Answer(502, json.dumps({"detail": detail}).encode())


def _json_document(body: bytes, content_encoding: str | None, max_bytes: int) -> bytes | None:
    """The batch's JSON text, if the relay can put it in a bundle: an object in strict JSON
    (one that is not would make the collector refuse the whole bundle)."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "gzip":
        inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        try:
            body = inflater.decompress(body, max_bytes)
        except zlib.error:
            return None
        if inflater.unconsumed_tail or not inflater.eof:
            return None
    elif encoding != "identity" or len(body) >= max_bytes:
        return None
    try:
        document = json.loads(body, parse_constant=_not_json)
    except (ValueError, RecursionError):
        return None
    return body.strip() if isinstance(document, dict) else None


def _not_json(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


def _handler(relay: NodeRelay) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # the ranks' shippers keep their connections open
        disable_nagle_algorithm = True  # else an answer's body waits for the headers' ACK

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))  # all of it:
            if self.path != INGEST_PATH:  # the connection's next request follows it
                self._answer(Answer(404, b'{"detail":"the node relay takes POST /v1/ingest"}'))
                return
            answer = relay.relay(
                body,
                content_encoding=self.headers.get("Content-Encoding"),
                authorization=self.headers.get("Authorization"),
            )
            self._answer(answer)

        def _answer(self, answer: Answer) -> None:
            try:
                self.send_response(answer.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer.body)))
                if answer.retry_after:
                    self.send_header("Retry-After", answer.retry_after)
                self.end_headers()
                self.wfile.write(answer.body)
            except OSError:  # the rank gave up waiting; it resends, and the collector dedups
                pass

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

    return Handler
