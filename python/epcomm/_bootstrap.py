"""How the ranks of an AllToAll find each other: a torch.distributed group, a host:port, EPCOMM_* variables or
any object with all_gather / barrier / broadcast."""

from __future__ import annotations

import os
import socket
from typing import Any, Optional

from . import _C
from ._tensors import invalid_argument

__all__ = ["make_bootstrap", "free_port", "TorchGroupBootstrap"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (bound to port 0 and released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return s.getsockname()[1]


def _resolve(name: str, timeout_s: float = 3.0) -> Optional[str]:
    """IPv4 address of `name`, or None when it does not resolve within `timeout_s` (a sandbox without a reachable DNS
    server can keep gethostbyname blocked for minutes). A daemon thread: a lookup still blocked cannot hold up the
    interpreter's exit."""
    import threading

    box: list = []

    def lookup() -> None:
        try:
            box.append(socket.gethostbyname(name))
        except OSError:
            box.append(None)

    t = threading.Thread(target=lookup, name="epcomm-resolve", daemon=True)
    t.start()
    t.join(timeout_s)
    return box[0] if box else None


def _rank0_address() -> str:
    # torchrun / torch.distributed.launch export MASTER_ADDR, reachable from every rank by construction.
    addr = os.environ.get("MASTER_ADDR")
    if addr:
        return _resolve(addr) or addr
    return _resolve(socket.gethostname()) or "127.0.0.1"


def _group_rank0(group: Any) -> int:
    import torch.distributed as dist

    if group is None:
        return 0
    if hasattr(dist, "get_global_rank"):
        return dist.get_global_rank(group, 0)
    return dist.distributed_c10d.get_global_rank(group, 0)  # older torch


def _torch_group_tcp(group: Any, rank: int, world_size: int) -> "_C.Bootstrap":
    """TCP rendezvous whose address rank 0 of `group` picks and broadcasts through the group."""
    import torch.distributed as dist

    g_rank = dist.get_rank(group)
    g_size = dist.get_world_size(group)
    if g_rank != rank or g_size != world_size:
        raise invalid_argument(
            f"rank={rank}, world_size={world_size} do not match the process group (rank {g_rank} of {g_size})")
    box = [None]
    if g_rank == 0:
        host = _rank0_address()
        try:
            port = free_port(host)
        except OSError:
            host = "127.0.0.1"
            port = free_port(host)
        box[0] = f"{host}:{port}"
    dist.broadcast_object_list(box, src=_group_rank0(group), group=group)
    return _C.tcp_bootstrap(box[0], rank, world_size)


class TorchGroupBootstrap:
    """Rendezvous carried by torch.distributed object collectives (no extra port). Pass an instance as
    ``bootstrap=`` when opening a port is not possible; the default for ``group=`` is a TCP rendezvous whose
    address travels through the group."""

    def __init__(self, group: Any = None):
        import torch.distributed as dist

        self._dist = dist
        self.group = group

    def all_gather(self, data: bytes) -> bytes:
        out = [None] * self._dist.get_world_size(self.group)
        self._dist.all_gather_object(out, data, group=self.group)
        return b"".join(out)

    def barrier(self) -> None:
        self._dist.barrier(group=self.group)

    def broadcast(self, data: bytes, root: int) -> bytes:
        box = [data]
        src = root if self.group is None else self._dist.get_global_rank(self.group, root)
        self._dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]


def make_bootstrap(bootstrap: Any, group: Any, rank: int, world_size: int) -> "_C.Bootstrap":
    """Resolves the `bootstrap=` / `group=` arguments of AllToAll:

    - an ``epcomm._C.Bootstrap``: used as is;
    - ``"host:port"``: TCP rendezvous, rank 0 listens there;
    - ``"env"``: EPCOMM_BOOTSTRAP / EPCOMM_RANK / EPCOMM_WORLD_SIZE;
    - an object with ``all_gather(bytes) -> bytes``, ``barrier()``, ``broadcast(bytes, root) -> bytes``;
    - None with ``group`` (a torch.distributed ProcessGroup) or with torch.distributed initialised: TCP rendezvous
      whose address rank 0 broadcasts through the group;
    - None with world_size == 1: a single-rank bootstrap;
    - None with EPCOMM_BOOTSTRAP set: TCP rendezvous at that address.
    """
    if isinstance(bootstrap, _C.Bootstrap):
        if bootstrap.rank != rank or bootstrap.world_size != world_size:
            raise invalid_argument(f"rank={rank}, world_size={world_size} do not match the bootstrap "
                                   f"(rank {bootstrap.rank} of {bootstrap.world_size})")
        return bootstrap
    if isinstance(bootstrap, str):
        if bootstrap == "env":
            return _C.env_bootstrap()
        if ":" not in bootstrap:
            raise invalid_argument(f"bootstrap='{bootstrap}' is neither 'env' nor 'host:port'")
        return _C.tcp_bootstrap(bootstrap, rank, world_size)
    if bootstrap is not None:
        return _C.callback_bootstrap(bootstrap, rank, world_size)
    if group is not None:
        return _torch_group_tcp(group, rank, world_size)
    if world_size == 1:
        return _C.self_bootstrap()
    addr = os.environ.get("EPCOMM_BOOTSTRAP")
    if addr:
        return _C.tcp_bootstrap(addr, rank, world_size)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return _torch_group_tcp(None, rank, world_size)
    except ImportError:
        pass
    raise invalid_argument(
        "no way to rendezvous: pass group= (torch.distributed), bootstrap='host:port', set EPCOMM_BOOTSTRAP, or "
        "initialise torch.distributed")

