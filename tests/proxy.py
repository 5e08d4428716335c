"""A TCP proxy on 127.0.0.1 that breaks a stream for real, to test what clients do when one breaks."""

from __future__ import annotations

import contextlib
import socket
import threading


class DroppingProxy:
    """Forwards 127.0.0.1:port to a server; cuts the first SSE connection after `cut_after` events."""

    def __init__(self, upstream_port: int, cut_after: int = 5) -> None:
        self.upstream_port = upstream_port
        self.cut_after = cut_after
        self.cuts = 0
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                downstream, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pump, args=(downstream, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, downstream, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, to_client: bool) -> None:
        seen = b""
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if to_client and self.cuts == 0:
                    seen += data
                    if seen.count(b"id: ") >= self.cut_after:
                        self.cuts += 1
                        break  # drop the connection mid-stream
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def close(self) -> None:
        self._stop = True
        self.sock.close()
