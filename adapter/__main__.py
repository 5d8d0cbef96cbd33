"""Run the adapter alone: ``python -m adapter --config conf/config.json``.

Uvicorn serves it with MindIE's listener settings (address, port, TLS) and h11
limits on header size. SIGTERM first flips readiness and answers new inference
requests with 503, lets in-flight requests drain for ``drainTimeout`` seconds,
then stops; a second signal stops at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import time

import uvicorn
from llm_engine.config import load_settings

from adapter.app import create_app
from adapter.http_protocol import HeadDeadlineProtocol
from adapter.planes import Listener, bind, listeners

log = logging.getLogger("adapter")

MAX_HEADER_BYTES = 16 * 1024  # h11 rejects a request whose head (all headers) is larger
# Kernel send buffer of every connection. Left to autotuning it grows to tcp_wmem's maximum
# (MiBs) for a client that stops reading; fixed, a stalled stream blocks soon, and after
# streamWriteTimeout the adapter cancels it. Token streams need only a few KiB/s.
SEND_BUFFER_BYTES = 256 * 1024
UVICORN_HEADROOM = 64  # connections beyond 3 x maxLinkNum: health probes, metrics, the answers that shed load
KEEP_ALIVE_SECONDS = 5  # an idle client connection is closed after this (uvicorn's default), and a
# request head must arrive within it (adapter.http_protocol)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, admission, drain_timeout: float):
        super().__init__(config)
        self.admission = admission
        self.drain_timeout = drain_timeout
        self._draining = False

    def handle_exit(self, sig, frame) -> None:
        if self._draining:
            return super().handle_exit(sig, frame)
        self._draining = True
        self.admission.stopping = True
        log.info("signal %s: draining %d in-flight requests (up to %.0fs)", sig, self.admission.in_flight,
                 self.drain_timeout)
        asyncio.get_event_loop().call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while self.admission.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        log.info("drained (%d still in flight); stopping", self.admission.in_flight)
        self.should_exit = True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default=None, help="settings file (default: $MINDIE_TRITON_CONFIG or conf/config.json)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [adapter] %(name)s: %(message)s")
    settings = load_settings(args.config)
    srv = settings.server
    app = create_app(settings)
    ssl = {}
    if srv.httpsEnabled:
        ssl = {"ssl_certfile": srv.tlsCert, "ssl_keyfile": srv.tlsPk}
        if srv.tlsCaFile:
            ssl["ssl_ca_certs"] = srv.tlsCaFile
    planes = listeners(srv)
    config = uvicorn.Config(
        app, host=planes[0].host, port=planes[0].port, log_level="info", access_log=False,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES, http=HeadDeadlineProtocol,
        # a last bound on connections, above what the admission guard lets run and wait (3 x
        # maxLinkNum), so that overload gets the guard's 503 + Retry-After and health probes answer
        limit_concurrency=srv.maxLinkNum * 3 + UVICORN_HEADROOM, timeout_graceful_shutdown=5,
        timeout_keep_alive=KEEP_ALIVE_SECONDS, **ssl,
    )
    sockets = [_listen(listener, srv.streamWriteTimeout) for listener in planes]
    for listener in planes:
        log.info("listening on %s:%d for the %s plane(s)", listener.url_host, listener.port,
                 ", ".join(sorted(listener.planes)))
    DrainingServer(config, app.state.admission, srv.drainTimeout).run(sockets=sockets)


def _listen(listener: Listener, write_timeout: float) -> socket.socket:
    """A listening socket for ``listener``; accepted connections inherit its options."""
    try:
        sock = bind(listener.host, listener.port)
    except OSError as exc:
        raise SystemExit(f"cannot listen on {listener.url_host}:{listener.port}: {exc}") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    # a peer that acknowledges nothing (or keeps a zero window) this long is disconnected by
    # the kernel; this frees the connection of a stalled stream that the adapter gave up on
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(write_timeout * 1000))
    # asyncio sets TCP_NODELAY only on sockets it creates itself; without it, a response
    # written as headers then body (or an SSE event after the headers) waited for the
    # client's delayed ACK: 44 ms for every GET with a body on a keep-alive connection
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


if __name__ == "__main__":
    main()
