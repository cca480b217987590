"""Rank 0's port, kept from other processes until rank 0's store binds it.

Without a shared rendezvous store (forked proxy launches; any launch with --max-restarts), torch's
rendezvous picks rank 0's port with `get_free_port`, which closes its socket at once: the port "is
not reserved and may be taken by another process" (its own docstring), and rank 0 binds it only
after the ranks start (CI: EADDRINUSE beside parallel tests). Here the port is left in TIME_WAIT
instead (the accepted end of a loopback connection closes first): for 60 s the kernel's own port
choices (a bind to port 0, a connect) skip it, and TCPStore, which binds with SO_REUSEADDR,
takes it. No library does this for torch's agent; it is the `ephemeral-port-reserve` technique.
"""

from __future__ import annotations

import socket
from contextlib import closing


def reserved_port() -> int:
    """A free TCP port held in TIME_WAIT: refused to binds without SO_REUSEADDR, open to TCPStore."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("", 0))
        server.listen(1)
        port = server.getsockname()[1]
        with closing(socket.create_connection(("127.0.0.1", port), timeout=5)) as client:
            accepted, _ = server.accept()
            accepted.close()  # this end closes first, so this end (local port: `port`) waits
            client.recv(1)  # its FIN has reached the client: the TIME_WAIT is the accepted end's
    return port


def use_reserved_ports() -> None:
    """Make torch's rendezvous in this process (a launcher's agent) hand rank 0 a reserved port."""
    from torch.distributed.elastic.rendezvous import api
    from torch.distributed.elastic.utils.distributed import get_free_port

    def port() -> int:
        try:
            return reserved_port()
        except OSError:  # no IPv4 loopback: torch's own choice
            return get_free_port()

    api.get_free_port = port  # RendezvousStoreInfo.build's choice of rank 0's port
