"""The server's listening socket, opened before the model loads: a busy port is reported at
once, not after a load of seconds or minutes, and uvicorn serves on this socket once ready
(connections made meanwhile wait in the backlog)."""

from __future__ import annotations

import errno
import socket


class PortInUse(OSError):
    """The host:port the server was asked to listen on is taken."""

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno 98]" prefix
        return str(self.strerror)


def listen_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A socket bound to host:port and listening, as uvicorn would open it (SO_REUSEADDR, so a
    port left in TIME_WAIT by a previous server is reused)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortInUse(
                e.errno,
                f"port {port} on {host} is already in use (another server?): stop it or pick another with --port N",
            ) from None
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock
