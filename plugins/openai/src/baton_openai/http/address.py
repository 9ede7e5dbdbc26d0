"""The server's address: bound before the model loads, and whether other machines can reach it."""

from __future__ import annotations

import errno
import ipaddress
import socket

from baton.errors import BatonError


class BindError(BatonError, OSError):
    """The server's address cannot be bound (in use, not local, no permission)."""


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Bound (not yet listening) sockets for ``host:port``, as uvicorn would bind them."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as e:
        raise BindError(
            f"cannot listen on {where}: {e.strerror}; set --host / server.host to an address "
            "of this machine"
        ) from None
    sockets: list[socket.socket] = []
    seen = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and len(infos) > 1:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.set_inheritable(True)
    except OSError as e:
        for sock in sockets:
            sock.close()
        hint = (
            "another process is listening there: stop it, or choose another --port / server.port"
            if e.errno == errno.EADDRINUSE
            else "check --host / --port (server.host, server.port)"
        )
        raise BindError(f"cannot listen on {where}: {e.strerror or e}; {hint}") from None
    return sockets


def is_loopback(host: str) -> bool:
    """True when ``host`` is reachable only from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)
