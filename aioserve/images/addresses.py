"""Which addresses an image URL may reach: the public internet's only,
unless the server allows private ones. A client must not make the server
fetch from its own network (a cloud's metadata service at 169.254.169.254,
an admin port on localhost)."""

from __future__ import annotations

import ipaddress

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# NAT64's well-known prefix: its addresses stand for the IPv4 one in their low bits.
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


def embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries (mapped, 6to4, NAT64), if any:
    ::ffff:127.0.0.1 reaches 127.0.0.1."""
    if isinstance(address, ipaddress.IPv4Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def is_public(address: IPAddress) -> bool:
    """Globally routable unicast: not loopback, private, link-local, shared
    (100.64/10), reserved, unspecified or multicast; an IPv6 address that
    carries an IPv4 one is judged by that one too."""
    inner = embedded_ipv4(address)
    if inner is not None and not is_public(inner):
        return False
    return address.is_global and not address.is_multicast
