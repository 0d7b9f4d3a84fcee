"""Which network interface a fsdp2 rank's gloo group uses: the one that holds the rank's
Ray node address.

Left to itself, gloo binds (and tells its peers) the address this machine's hostname
resolves to, and falls back to loopback where that is not bindable. On a machine whose
hostname resolves to 127.0.0.1 (most containers, the multi-host test bed's hosts) a rank
then told its peers on another machine to connect to 127.0.0.1: measured here, "Gloo
connectFullMesh failed ... Connection refused, remote=[127.0.0.1]". The rank's Ray node
address is the one the cluster reaches it at (``ray start --node-ip-address``), so the
rank's gloo uses the interface holding that address (``GLOO_SOCKET_IFNAME``), unless the
environment already names one. NCCL (CUDA cells) picks its bootstrap interface itself,
skipping loopback, and is left alone.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import psutil

GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"


def interface_of(ip: str, addrs: Mapping[str, Sequence[Any]] | None = None) -> str | None:
    """The name of the interface that holds address ``ip`` (``addrs``: ``psutil.net_if_addrs()``
    by default), or None when none does."""
    want = ipaddress.ip_address(ip)
    for name, entries in (psutil.net_if_addrs() if addrs is None else addrs).items():
        for entry in entries:
            if entry.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                if ipaddress.ip_address(str(entry.address).split("%")[0]) == want:
                    return name
            except ValueError:
                continue
    return None


def pin_gloo_interface(node_ip: str, environ: MutableMapping[str, str] | None = None,
                       addrs: Mapping[str, Sequence[Any]] | None = None) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` (in ``environ``, this process's by default) to the interface
    holding ``node_ip`` unless it is already set; the interface gloo will use (None: neither
    set nor found, gloo's own choice stands)."""
    env = os.environ if environ is None else environ
    if env.get(GLOO_IFNAME_ENV):
        return env[GLOO_IFNAME_ENV]
    name = interface_of(node_ip, addrs)
    if name is not None:
        env[GLOO_IFNAME_ENV] = name
    return name


__all__ = ["GLOO_IFNAME_ENV", "interface_of", "pin_gloo_interface"]
