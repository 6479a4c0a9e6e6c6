"""Where `specserve serve` listens: one host, loopback unless `--host` or the config's `http_options.host` says
otherwise, for the HTTP proxy, the gRPC proxy, metrics and every worker port.

Ray Serve 2.60 binds its gRPC proxy to `[::]:<port>` (`start_grpc_server` in ray/serve/_private/grpc_util.py, through
`default_impl.add_grpc_address`, which Serve declares an extension point) and each replica's inter-deployment gRPC
server to `[::]:0` (ray/serve/_private/replica.py), whatever `http_options.host` says: neither has an option.
`bind_serve_sockets` is a Ray `worker_process_setup_hook` set in the job-level runtime_env of the Ray that `specserve
serve` starts; in every worker process of that job (Serve's controller, proxies and replicas) it rewrites those two
binds to the chosen host and to the node's cluster address. Ray's own ports (GCS, raylet, agents, the metrics
exporter, every core worker) and specserve's worker servers follow Ray's node IP: with a loopback host `specserve
serve` starts Ray in its local-only mode (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, Ray's default on macOS and Windows),
whose node IP is 127.0.0.1.
"""

from __future__ import annotations

import ipaddress
import logging
import os

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
HOST_ENV = "SPECSERVE_BIND_HOST"  # read by the setup hook in Ray's worker processes
SETUP_HOOK = "specserve.cluster.serve.serve_binds.bind_serve_sockets"
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray on one machine, node IP 127.0.0.1
_ANY = "[::]:"


def _ip(host: str):
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    ip = _ip(host)
    if ip is None:
        return False
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def is_wildcard(host: str) -> bool:
    """Every interface: 0.0.0.0, :: or an empty host."""
    ip = _ip(host) if host else None
    return not host or (ip is not None and ip.is_unspecified)


def host_port(host: str, port: int | str) -> str:
    """host:port as gRPC and URLs spell it ([v6]:port)."""
    ip = _ip(host)
    return f"[{host.strip('[]')}]:{port}" if ip is not None and ip.version == 6 else f"{host}:{port}"


def _rebind(address: str, host: str) -> str:
    return host_port(host, address.removeprefix(_ANY)) if address.startswith(_ANY) else address


def bind_serve_sockets() -> None:
    """Ray worker_process_setup_hook: Serve's gRPC proxy binds $SPECSERVE_BIND_HOST instead of every interface, and
    each replica's inter-deployment gRPC server binds Ray's node IP (where other replicas reach it) instead."""
    host = os.environ.get(HOST_ENV, "")
    if is_wildcard(host):
        return
    try:
        from ray.serve._private import default_impl, replica

        proxy_add, replica_add = default_impl.add_grpc_address, replica.add_port_to_grpc_server
    except (ImportError, AttributeError) as e:  # Ray's internals moved: tests/cluster/serve/test_serve_binds.py fails
        log.warning("cannot bind Serve's gRPC servers to %s (%s): they listen on every interface", host, e)
        return

    def add_grpc_address(server, address: str):
        return proxy_add(server, _rebind(address, host))

    def add_port_to_grpc_server(server, address: str):
        import ray

        return replica_add(server, _rebind(address, ray.util.get_node_ip_address()))

    default_impl.add_grpc_address = add_grpc_address
    replica.add_port_to_grpc_server = add_port_to_grpc_server
