"""`specserve serve`: a local Ray + Serve running the application from a Serve config file (or the embedded default:
SmolLM2-135M-Instruct on CPU, drafting with its packaged EAGLE-3 head if one is packaged, else n-gram; `--model demo`
for the demo family), until SIGINT/SIGTERM, then a clean shutdown of Serve and of the Ray it started.

Everything it opens listens on one host, loopback by default (cluster/serve/serve_binds.py); another host without an API
key logs a warning. Serve's proxies refuse gRPC messages over the app's `limits.max_grpc_message_bytes` and HTTP bodies
over `limits.max_request_bytes` before buffering them (cluster/serve/proxy_limits.py)."""

from __future__ import annotations

import functools
import logging
import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from specserve.cluster.app_config import (
    APP_NAME,
    DEFAULT_MODEL,
    DEMO,
    AppConfig,
    app_config,
    demo_model,
    load_serve_config,
    serve_config,
)
from specserve.cluster.serve.local_ray import init_ray
from specserve.cluster.serve.proxy_limits import CALLBACK_ENV, GRPC_MESSAGE_ENV, proxy_env
from specserve.cluster.serve.serve_binds import (
    DEFAULT_HOST,
    HOST_ENV,
    LOCAL_ONLY_ENV,
    SETUP_HOOK,
    host_port,
    is_loopback,
    is_wildcard,
)
from specserve.workers.errors import InvalidRequestError

log = logging.getLogger(__name__)


def prepare_config(config_path: str | None, grpc_port: int | None, http_port: int | None, model: str | None = None,
                   draft: str | None = None, host: str | None = None,
                   overrides: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """The Serve config to run: the file's, or the default (`model`, `draft` and the model's other `overrides` when
    given: `specserve serve`'s flags), with port and host overrides (`host`: where the HTTP and gRPC proxies listen)."""
    if config_path and overrides:
        raise InvalidRequestError(next(iter(overrides)), "applies without --config (the config file names its models)")
    config = (load_serve_config(config_path) if config_path
              else serve_config(single_model_app(model, draft, overrides)))  # fmt: skip
    if host is not None:
        config.setdefault("http_options", {})["host"] = host
    if grpc_port is not None:
        config.setdefault("grpc_options", {})["port"] = grpc_port
    if http_port is not None:
        config.setdefault("http_options", {})["port"] = http_port
    return config


def single_model_app(model: str | None, draft: str | None, overrides: dict[str, Any] | None = None) -> AppConfig:
    """An app serving one model: the default (SmolLM2-135M-Instruct), the demo family, or any name / .gguf file /
    directory, served under its name (a path's file or directory name); without `draft`, with the target's packaged
    EAGLE-3 head if any, else n-gram (ModelPairConfig's default). overrides: more of the model's fields (device,
    dtype, k, speculative_config, target_pool)."""
    overrides = overrides or {}
    if model == DEMO and draft is None:
        return app_config({"models": [demo_model().model_dump() | overrides]})
    if model is None and draft is None and not overrides:
        return AppConfig()
    target = model or DEFAULT_MODEL
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(target).name.removesuffix(".gguf"))[:128] or "model"
    fields = {"name": name, "target": target, **({"draft": draft} if draft else {}), **overrides}
    return app_config({"models": [fields]})


class _WarningsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


def _quiet_serve_logger() -> None:
    """Serve's INFO lines in this process ("Started <ray.serve._private.router.SharedRouterLongPollClient object at
    0x7f...>") say nothing to whoever reads the terminal: specserve says what it starts. Its warnings still show. A
    filter on the logger, which Serve's set-up at its import keeps (it resets the level and the handlers), so that
    Ray is not imported here, before `start` makes it local-only."""
    logger = logging.getLogger("ray.serve")
    if not any(isinstance(f, _WarningsOnly) for f in logger.filters):
        logger.addFilter(_WarningsOnly())


def start(config: dict[str, Any], metrics_port: int | None = None, ready_timeout_s: float = 1800.0) -> dict:
    """Start Ray (unless connected), Serve and the app; returns once every pool serves. Returns the addresses."""
    _quiet_serve_logger()
    app_entry = _specserve_app(config)
    app = app_config(app_entry.get("args") or {})
    http = {"host": DEFAULT_HOST, "port": 8000, **(config.get("http_options") or {})}
    host = http["host"]
    fresh = "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
    local_only = fresh and is_loopback(host) and not os.environ.get("RAY_ADDRESS")
    if local_only:  # before Ray is imported: it reads this once, at import
        os.environ[LOCAL_ONLY_ENV] = "0"

    from specserve.cluster.serve.replica_env import resolve_paths

    for m in app.models:
        log.info("model %r: target %s, draft %s", m.name, m.target, m.draft)
        resolve_paths(m)  # pull, convert or install with progress here, before any replica looks for it
    started_ray = _init_ray(host, metrics_port, local_only)
    _warn_without_api_key(host, app)
    grpc_opts = config.get("grpc_options") or {}
    name = app_entry.get("name", APP_NAME)
    _deploy(config, app, http, grpc_opts, name, ready_timeout_s)
    connect = DEFAULT_HOST if is_wildcard(host) else host
    return {
        "app": name,
        "host": host,
        "grpc": host_port(connect, grpc_opts.get("port", 9000)),
        "http": f"{'https' if http.get('ssl_certfile') else 'http'}://{host_port(connect, http['port'])}",
        "metrics": f"http://{host_port(connect, metrics_port)}/metrics" if metrics_port else None,
        "started_ray": started_ray,
    }


def _init_ray(host: str, metrics_port: int | None, local_only: bool) -> bool:
    """Start a Ray for this process unless one is connected; returns whether this call started it."""
    import ray

    started_ray = not ray.is_initialized()
    if started_ray:
        # A Ray started here inherits this: Serve's 5 s proxy readiness limit killed and restarted proxies that
        # started slowly on busy 2-core machines.
        os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")
        # Ray 2.60 turns token authentication on for a new local cluster and warns that it did, on every start; it
        # stays on (RAY_AUTH_MODE=disabled opts out, as Ray documents), the line goes. Any other warning still shows.
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
        init: dict = {"include_dashboard": False, "configure_logging": False, "log_to_driver": False}
        if metrics_port is not None:
            init["_metrics_export_port"] = metrics_port
        if local_only:
            init["address"] = "local"  # a Ray of its own, never one that `ray start` left running on other addresses
        if not is_wildcard(host):
            init["runtime_env"] = {"worker_process_setup_hook": SETUP_HOOK, "env_vars": {HOST_ENV: host}}
        init_ray(**init)
    node_ip = ray.util.get_node_ip_address()
    if started_ray and is_loopback(host) and not is_loopback(node_ip):
        log.warning("Ray's own ports and the workers' gRPC ports listen on the node address %s, not on %s: this Ray "
                    "was not started by `specserve serve` in local-only mode", node_ip, host)  # fmt: skip
    return started_ray


def _deploy(config: dict[str, Any], app: AppConfig, http: dict, grpc_opts: dict, name: str, timeout_s: float) -> None:
    """Start Serve with the proxies' limits and deploy the config's applications; returns once every pool serves."""
    from ray import serve
    from ray.serve.config import HTTPOptions, gRPCOptions
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    # Serve's proxies read their limits from the environment (cluster/serve/proxy_limits.py): they inherit the
    # controller's runtime_env, the one supported way to set it from here (only when this call starts Serve).
    env = proxy_env(app.limits.max_grpc_message_bytes, app.limits.max_request_bytes)
    if os.environ.get(CALLBACK_ENV):  # the user's own proxy callback stays
        env = {k: v for k, v in env.items() if k == GRPC_MESSAGE_ENV}
    serve.start(
        http_options=HTTPOptions(**http),  # TLS: ssl_keyfile/ssl_certfile
        grpc_options=gRPCOptions(**grpc_opts),
        controller_options={"runtime_env": {"env_vars": env}},
    )
    log.info("starting application %r: %d model(s) ...", name, len(app.models))
    # Deployed from the config, as `serve deploy` and KubeRay do, so every key of the file applies (deployment
    # overrides, the application-level autoscaling policy), not only specserve's args.
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))
    _wait_running(name, timeout_s)
    handle = serve.get_app_handle(name)
    handle.wait_ready.remote(timeout_s).result(timeout_s=timeout_s + 30)


def _warn_without_api_key(host: str, app: AppConfig) -> None:
    if is_loopback(host):
        return
    env = app.auth.api_key_env
    if env and os.environ.get(env):
        return
    how = f"set {env} in this environment" if env else "set auth.api_key_env in the config and that variable"
    log.warning("listening on %s without an API key: anyone who can reach this address can use the models; %s, "
                "or bind to 127.0.0.1 (the default)", host, how)  # fmt: skip


def _wait_running(name: str, timeout_s: float) -> None:
    import time

    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        app = serve.status().applications.get(name)
        status = str(app.status) if app else "NOT_STARTED"
        if status.endswith("RUNNING"):
            return
        if status.endswith("DEPLOY_FAILED") or time.monotonic() > deadline:
            raise RuntimeError(f"application {name!r} did not start ({status}): {app.message if app else ''}")
        time.sleep(1)


_STOP_NOISE = "killed by `ray.kill`"


def _drop_stop_noise() -> None:
    """serve.shutdown() kills Serve's controller; the calls still queued on it (proxies' long polls, its own graceful
    shutdown) then fail "because it was killed by `ray.kill`", and Ray prints each failure on this terminal as a
    "(raylet)" line. They say only that the stop happened: drop exactly them, pass every other line. Ray has no
    public hook for this: both of its printing paths (pushed errors and streamed worker logs) go through
    ray._private.worker.print_to_stdstream (Ray pinned at 2.60); if that moves, the lines show again, nothing else."""
    try:
        from ray._private import worker as ray_worker
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return
    printer = getattr(ray_worker, "print_to_stdstream", None)
    if printer is None or getattr(printer, "drops_stop_noise", False):
        return
    quiet = functools.partial(_without_stop_noise, printer)
    quiet.drops_stop_noise = True
    ray_worker.print_to_stdstream = quiet  # the error listener looks it up at each call
    for name, handler in list(getattr(dispatcher, "handlers", [])):
        if name == "ray_print_logs":  # bound when Ray connected: rebind it through the filter
            dispatcher.remove_handler(name)
            dispatcher.add_handler(name, functools.partial(_without_stop_noise, handler))


def _without_stop_noise(printer, data: dict, *args, **kwargs) -> None:
    lines = [line for line in data.get("lines", []) if _STOP_NOISE not in line]
    if lines:
        printer({**data, "lines": lines}, *args, **kwargs)


def stop(info: dict) -> None:
    import ray
    from ray import serve

    from specserve.cluster.serve.registry import kill_registry

    _drop_stop_noise()
    serve.shutdown()
    kill_registry(info["app"])
    if info.get("started_ray"):
        ray.shutdown()


def _specserve_app(config: dict[str, Any]) -> dict[str, Any]:
    """The Serve config's entry of specserve's application."""
    return next(a for a in config["applications"] if a.get("import_path", "").startswith("specserve."))


def _drain(app: str, timeout_s: float) -> None:
    """Finish the running requests (no new ones) before stopping; a second Ctrl-C / SIGTERM stops at once."""
    from specserve.cluster.serve.drain import drain

    now = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: now.set())
    print(f"draining: no new requests; the running ones have up to {timeout_s:g} s (Ctrl-C again to stop now)",
          flush=True)  # fmt: skip
    left = drain(app, timeout_s, now)
    if left:
        print(f"stopping with {left} requests unfinished", flush=True)


def serve_forever(config_path: str | None, grpc_port: int | None, http_port: int | None,
                  metrics_port: int | None, grpc_tls=None, model: str | None = None,
                  draft: str | None = None, host: str | None = None,
                  overrides: dict[str, Any] | None = None) -> int:  # fmt: skip
    """Run until SIGINT/SIGTERM. `grpc_tls` (a GatewayConfig): also serve the gRPC API over TLS, forwarding to
    this Serve's proxy, on the same host as the proxies and with the same message limit."""
    stop_event = threading.Event()
    config = prepare_config(config_path, grpc_port, http_port, model, draft, host, overrides)
    info = start(config, metrics_port)
    gateway = None
    try:
        if grpc_tls is not None:
            from specserve.cluster.serve.tls_gateway import GatewayThread

            app = _specserve_app(config)
            update = {
                "upstream": info["grpc"],
                "app_name": info["app"],
                "listen": host_port(info["host"], grpc_tls.listen.rsplit(":", 1)[1]),
                "max_message_bytes": app_config(app.get("args") or {}).limits.max_grpc_message_bytes,
            }
            gateway = GatewayThread(grpc_tls.model_copy(update=update))
            print(f"specserve gRPC over TLS on port {gateway.port} (mutual TLS: "
                  f"{'on' if grpc_tls.client_ca else 'off'})", flush=True)  # fmt: skip
        # After start(): ray.init installs its own fatal-signal handler for SIGTERM.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop_event.set())
        print(f"specserve is serving: gRPC {info['grpc']} (specserve.v1.SpecServe, reflection on), "
              f"HTTP {info['http']}/v1 (OpenAI-compatible)"
              + (f", metrics {info['metrics']}" if info["metrics"] else ""), flush=True)  # fmt: skip
        log.info("Ctrl-C (SIGINT) or SIGTERM stops it, after the requests running finish")
        while not stop_event.wait(0.5):
            pass
        _drain(info["app"], app_config(_specserve_app(config).get("args") or {}).scheduler.drain_timeout_s)
        log.info("shutting down ...")
    finally:
        if gateway is not None:
            gateway.stop()
        stop(info)
    log.info("stopped")
    return 0
