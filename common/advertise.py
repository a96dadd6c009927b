"""The address a worker gives its peers, decided once at start.

A worker is reached at one host: the gateways call its gRPC port there (the registry lists it),
and encoders and language workers reach each other's transfer endpoint (the ZMQ control socket
and the Mooncake session) there. ``advertised_host`` picks it:

- ``--advertise-host`` when given;
- else the bind host (``--host``) when that is one address;
- else (``0.0.0.0`` / ``::``, every interface, as in a pod) the source address of the interface
  that routes to the first gateway that resolves (no packet is sent: a UDP socket's
  ``connect`` only asks the routing table), or 127.0.0.1 when every gateway is on loopback.

``transfer_host`` is the transfer plane's: ``--transfer-host`` when given, else the same host.

What can never work is an error at start, with the flag to set: an unspecified address
(``0.0.0.0`` is not a destination), a loopback address while a gateway is on another host (the
gateway, or a peer on another host, would reach itself), an address literal that is none of this
host's (the transfer plane must bind it; Mooncake's handshake to an unreachable host hangs
instead of failing), a name that does not resolve.
"""

from __future__ import annotations

import ipaddress
import socket

from common.registration import parse_gateways

LOOPBACK = "127.0.0.1"


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _resolve(host: str) -> list[str]:
    """Every address ``host`` (a literal or a name) stands for; [] when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError):
        return []
    return list(dict.fromkeys(info[4][0] for info in infos))


def is_loopback(host: str) -> bool:
    """True when every address ``host`` stands for is a loopback one (``localhost`` too)."""
    addresses = [_ip(a) for a in _resolve(host)] if _ip(host) is None else [_ip(host)]
    return bool(addresses) and all(a is not None and a.is_loopback for a in addresses)


def is_unspecified(host: str) -> bool:
    address = _ip(host)
    return host == "" or (address is not None and address.is_unspecified)


def is_local(address: str) -> bool:
    """True when ``address`` (a literal) is one of this host's: it can be bound."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.bind((address.strip("[]"), 0))
        except OSError:
            return False
    return True


def route_source(destination: str) -> str:
    """The local address the kernel would send from to ``destination`` (an address literal)."""
    family = socket.AF_INET6 if ":" in destination else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect((destination, 9))  # UDP connect: a route lookup, nothing is sent
        return sock.getsockname()[0]


def _gateway_hosts(gateway: str) -> list[str]:
    return [host for host, _ in parse_gateways(gateway)]


def _check(host: str, flag: str, gateway: str) -> str:
    """``host`` when peers can reach it; ValueError naming ``flag`` otherwise."""
    if is_unspecified(host):
        raise ValueError(f"{flag} {host!r} is not an address a peer can reach; give this host's")
    remote = [g for g in _gateway_hosts(gateway) if not is_loopback(g)]
    if is_loopback(host) and remote:
        raise ValueError(
            f"{flag} {host} is a loopback address, but gateway {remote[0]} is on another host: "
            f"it and the other workers cannot reach this worker there; set {flag} to an address "
            "of this host they reach"
        )
    literal = _ip(host)
    if literal is not None and not is_local(str(literal)):
        raise ValueError(f"{flag} {host} is not an address of this host")
    if literal is None and not _resolve(host):
        raise ValueError(f"{flag} {host!r} does not resolve")
    return host


def advertised_host(advertise_host: str, bind_host: str, gateway: str) -> str:
    """The host a worker's peers reach it at (see the module docstring)."""
    if advertise_host:
        return _check(advertise_host, "--advertise-host", gateway)
    if not is_unspecified(bind_host):
        return _check(bind_host, "--advertise-host (here: --host)", gateway)
    remote = [g for g in _gateway_hosts(gateway) if not is_loopback(g)]
    for gateway_host in remote:
        for address in _resolve(gateway_host):
            try:
                return route_source(address)
            except OSError:
                continue  # no route to this one
    if remote:
        raise ValueError(
            f"no route to any gateway ({', '.join(remote)}) to find this worker's address "
            "from; set --advertise-host"
        )
    return LOOPBACK


def transfer_host(transfer: str, advertised: str, gateway: str) -> str:
    """The transfer plane's host: ``--transfer-host``, else the advertised host."""
    if not transfer:
        return advertised
    return _check(transfer, "--transfer-host", gateway)


def unreachable_reason(address: str, peer: str) -> str:
    """Why a worker that advertises ``address`` (host:port) cannot be reached from where its
    registration came from (``peer``: gRPC's ``context.peer()``, ``ipv4:10.0.0.5:41234``); ""
    when it can, as far as the registry can tell. A loopback address from a caller on another
    host names the registry's own host, not the worker's."""
    host = address.rpartition(":")[0].strip("[]")
    if is_unspecified(host):
        return f"worker address {address} is unspecified: start it with --advertise-host"
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return ""  # a unix socket or an unknown transport: same host
    peer_ip = _ip(rest.rpartition(":")[0].strip("[]"))
    caller_remote = peer_ip is not None and not peer_ip.is_loopback
    local_host = _ip(host)
    if caller_remote and local_host is not None and local_host.is_loopback:
        return (
            f"worker address {address} is a loopback address, but it registers from "
            f"{peer_ip}, another host: start it with --advertise-host (an address this gateway "
            "reaches)"
        )
    return ""
