"""Loopback by default: the host helpers, the Ray setup hook that rebinds Serve's hard-wired `[::]` gRPC servers, the
API-key warning, and (slow) a default `specserve serve` whose every process listens on loopback only."""

import ipaddress
import logging
import os
import signal
import subprocess
import sys
import uuid

import psutil
import pytest
import yaml

from specserve.cluster.app_config import AppConfig, serve_config
from specserve.cluster.serve import serve_binds
from specserve.cluster.serve.server import _warn_without_api_key, prepare_config
from specserve.workers.service.local_processes import free_port
from tests.helpers.serve_process import marked_processes, wait_until_serving
from tests.helpers.tls_certs import CertAuthority


@pytest.mark.parametrize(
    ("host", "loopback", "wildcard", "grpc"),
    [
        ("127.0.0.1", True, False, "127.0.0.1:9"),
        ("127.0.0.2", True, False, "127.0.0.2:9"),
        ("localhost", True, False, "localhost:9"),
        ("::1", True, False, "[::1]:9"),
        ("::ffff:127.0.0.1", True, False, "[::ffff:127.0.0.1]:9"),
        ("0.0.0.0", False, True, "0.0.0.0:9"),
        ("::", False, True, "[::]:9"),
        ("", False, True, ":9"),
        ("10.1.2.3", False, False, "10.1.2.3:9"),
        ("example.org", False, False, "example.org:9"),
    ],
)
def test_host_helpers(host, loopback, wildcard, grpc):
    assert serve_binds.is_loopback(host) is loopback
    assert serve_binds.is_wildcard(host) is wildcard
    assert serve_binds.host_port(host, 9) == grpc


def test_setup_hook_rebinds_serves_any_address_binds(monkeypatch):
    import ray
    from ray.serve._private import default_impl, replica

    bound = []
    monkeypatch.setattr(default_impl, "add_grpc_address", lambda server, address: bound.append(("proxy", address)))
    monkeypatch.setattr(replica, "add_port_to_grpc_server", lambda server, address: bound.append(("replica", address)))
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.7")
    monkeypatch.setenv(serve_binds.HOST_ENV, "127.0.0.1")
    serve_binds.bind_serve_sockets()
    default_impl.add_grpc_address(None, "[::]:9000")
    replica.add_port_to_grpc_server(None, "[::]:0")
    default_impl.add_grpc_address(None, "10.0.0.7:9000")  # an address Serve chose itself is left alone
    assert bound == [("proxy", "127.0.0.1:9000"), ("replica", "10.0.0.7:0"), ("proxy", "10.0.0.7:9000")]


def test_setup_hook_leaves_serve_alone_for_a_wildcard_host(monkeypatch):
    from ray.serve._private import default_impl

    original = default_impl.add_grpc_address
    monkeypatch.setenv(serve_binds.HOST_ENV, "0.0.0.0")
    serve_binds.bind_serve_sockets()
    assert default_impl.add_grpc_address is original


def test_host_comes_from_the_flag_then_the_config_then_loopback(tmp_path):
    from specserve.cluster.cli.main import build_parser

    assert build_parser().parse_args(["serve"]).host is None
    assert build_parser().parse_args(["serve", "--host", "0.0.0.0"]).host == "0.0.0.0"
    assert serve_config()["http_options"]["host"] == "127.0.0.1"
    assert prepare_config(None, None, None)["http_options"]["host"] == "127.0.0.1"
    assert prepare_config(None, None, None, host="0.0.0.0")["http_options"]["host"] == "0.0.0.0"
    wide = tmp_path / "wide.yaml"
    wide.write_text(yaml.safe_dump(serve_config(http_host="0.0.0.0")))
    assert prepare_config(str(wide), None, None)["http_options"]["host"] == "0.0.0.0"
    assert prepare_config(str(wide), None, None, host="127.0.0.1")["http_options"]["host"] == "127.0.0.1"


def test_binding_wide_without_an_api_key_warns(monkeypatch, caplog):
    app = AppConfig()
    caplog.set_level(logging.WARNING, logger="specserve.cluster.serve.server")
    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    _warn_without_api_key("127.0.0.1", app)
    assert caplog.records == []
    _warn_without_api_key("0.0.0.0", app)
    assert "without an API key" in caplog.text and "SPECSERVE_API_KEY" in caplog.text
    caplog.clear()
    monkeypatch.setenv("SPECSERVE_API_KEY", "k-1")
    _warn_without_api_key("0.0.0.0", app)
    assert caplog.records == []
    _warn_without_api_key("0.0.0.0", AppConfig.model_validate({"auth": {"api_key_env": None}}))
    assert "without an API key" in caplog.text


def _listening(procs: list[psutil.Process]) -> list[tuple[str, str, int]]:
    found = []
    for p in procs:
        try:
            found += [(p.name(), c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN]  # fmt: skip
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return found


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    return (getattr(addr, "ipv4_mapped", None) or addr).is_loopback


@pytest.mark.slow
def test_default_serve_listens_on_loopback_only(tmp_path, tiny_target, tiny_draft):
    """Every socket that any process of a default `specserve serve` listens on (the CLI, Ray's GCS, raylet and agents,
    Serve's controller, proxies and replicas, the workers, the metrics exporter, the TLS gateway) is loopback."""
    from specserve.client import SpecServeClient

    pool = {"num_cpus": 0.5}
    app = AppConfig.model_validate(
        {"models": [{"name": "tiny", "target": tiny_target, "draft": tiny_draft, "device": "cpu",
                     "target_pool": pool, "draft_pool": pool}], "scheduler": {"num_cpus": 0.5}}
    )  # fmt: skip
    config_file = tmp_path / "serve.yaml"
    config_file.write_text(yaml.safe_dump(serve_config(app)))  # the default host: no --host, none in the file
    ca = CertAuthority(tmp_path)
    key, cert = ca.issue("server")
    ports = {"grpc": free_port(), "http": free_port(), "metrics": free_port(), "tls": free_port()}
    marker = uuid.uuid4().hex
    env = {**os.environ, "SPECSERVE_TEST_MARKER": marker, "SPECSERVE_HOME": str(tmp_path / "home")}
    env.pop("SPECSERVE_API_KEY", None)
    cmd = [sys.executable, "-m", "specserve.cluster.cli.main", "serve", "--config", str(config_file),
           "--grpc-port", str(ports["grpc"]), "--http-port", str(ports["http"]), "--metrics-port",
           str(ports["metrics"]), "--grpc-tls-cert", cert, "--grpc-tls-key", key, "--grpc-tls-port",
           str(ports["tls"])]  # fmt: skip
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    try:
        wait_until_serving(proc, 400)
        with SpecServeClient(f"127.0.0.1:{ports['grpc']}", timeout_s=120) as client:
            assert client.generate("def add(a, b):", max_new_tokens=8, k=2)["token_ids"]
        with SpecServeClient(f"127.0.0.1:{ports['tls']}", timeout_s=120, ca_file=ca.cert_file) as client:
            assert client.generate("def add(a, b):", max_new_tokens=8, k=2)["token_ids"]
        tree = psutil.Process(proc.pid)
        procs = list({p.pid: p for p in [tree, *tree.children(recursive=True), *marked_processes(marker)]}.values())
        names = {p.name() for p in procs}
        assert {"raylet", "gcs_server", "ray::ProxyActor"} <= names
        assert any(n.startswith("ray::ServeReplica:specserve:target-tiny") for n in names)
        sockets = _listening(procs)
        print("\n".join(f"{name:60} {ip}:{port}" for name, ip, port in sorted(sockets)))
        assert {port for _, _, port in sockets} >= set(ports.values())
        workers = [s for s in sockets if s[0].startswith("ray::ServeReplica:specserve:") and "-tiny" in s[0]]
        assert len(workers) >= 2 * 3  # draft and target: their worker server and Ray's and Serve's own
        assert [s for s in sockets if not _loopback(s[1])] == []
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
            for p in marked_processes(marker):
                p.kill()
    assert "without an API key" not in log.read_text()
