"""The HTTP server around the app: uvicorn, taught to refuse slow clients and to stop cleanly.

Two things a bare uvicorn does not do, and a server on a network must:

* **Slow clients cannot hold it.** A client that opens a connection and sends its headers a byte at
  a time ("slowloris") keeps a connection -- and a file descriptor -- for as long as it likes.
  :func:`guarded_protocol` gives every connection ``header_timeout`` seconds to send a request's
  headers (its first, and each next one on a kept-alive connection), after which it gets ``408`` and
  is closed; and no more than ``max_connections`` connections are open at once: one more gets
  ``503`` and is closed at once. (The body has its own limit in the app: ``--body-timeout``.)
* **A clean exit.** On the first SIGTERM (or Ctrl-C) :class:`Server` stops taking requests, ends the
  live view's endless streams, lets the requests in flight finish for up to ``drain_timeout``
  seconds, then aborts the rest -- a stream ends with an error event, a whole answer is a ``503`` --
  and uvicorn's shutdown then stops the engine cores; a second signal aborts the rest at once. The
  process exits 0; it exits 1 if an engine core died (its requests failed at once; the other cores'
  finished in the same drain). The drain's start, what it aborted and its end are logged
  (:class:`~.server_logs.ServeLog`).
"""
from __future__ import annotations

import contextlib
import json
import signal
import threading


def _response(status: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def guarded_protocol(header_timeout: float, max_connections: int):
    """uvicorn's h11 protocol with a header read timeout and a cap on open connections."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        timer = None
        armed_for = None  # the request cycle that was current when the timer was armed

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.write(_response("503 Service Unavailable", f"the server has {max_connections} "
                                          "connections open, its limit (--max-connections); retry later",
                                          "too_many_connections"))
                transport.close()
                return
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self.armed_for = self.cycle
            self.timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def _disarm(self) -> None:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None

        def _headers_too_slow(self) -> None:
            self.timer = None
            if self.cycle is self.armed_for and not self.transport.is_closing():  # no new request began
                self.transport.write(_response("408 Request Timeout", f"the request's headers did not arrive within "
                                               f"{header_timeout:g} s (--header-timeout)", "timeout"))
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.timer is not None and self.cycle is not self.armed_for:
                self._disarm()  # a request's headers were read: the app has it now

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request on this kept-alive connection has the same time

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11Protocol


def server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server with the drain described in the module docstring."""

        frontend = None
        startup_signals = None  # serve's StartupSignals: a signal it noted is honoured when these handlers start
        drain_timeout = 4.0  # serve's --drain-timeout default
        draining = False
        loop = None

        async def startup(self, sockets=None) -> None:
            import asyncio

            self.loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)

        def handle_exit(self, sig, frame) -> None:
            if self.frontend is not None and self.loop is not None:
                if not self.draining:
                    self.draining = True
                    self.loop.call_soon_threadsafe(self._drain)
                elif sig is not None:  # a second signal: the operator will not wait -- abort what is left now
                    self.loop.call_soon_threadsafe(self.frontend.abort_all)
            super().handle_exit(sig, frame)

        def _drain(self) -> None:
            fe = self.frontend
            fe.draining = True
            fe.log.drain_started(self.drain_timeout)
            fe.hub.close()
            self.loop.call_later(self.drain_timeout, fe.abort_all)

        def exit_soon(self, why: str, delay: float = 2.0) -> None:
            """An engine core died: for ``delay`` seconds the server still answers (``/health``: 503) while the
            failed requests' errors go out; then it stops."""
            if self.loop is not None:
                self.loop.call_later(delay, self.handle_exit, None, None)

        @contextlib.contextmanager
        def capture_signals(self):
            """SIGINT and SIGTERM start the drain, and the process then exits with our status (uvicorn's own
            version re-raises the signal after shutdown, which ends the process with -15 however cleanly it
            stopped)."""
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            noted = getattr(self.startup_signals, "received", None)
            if noted is not None:  # a signal came between the start-up's last check and these handlers
                self.handle_exit(getattr(signal, noted), None)
            try:
                yield
            finally:
                for s, handler in old.items():
                    signal.signal(s, handler)

    return Server
