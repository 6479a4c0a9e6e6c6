"""The Serve application's one configuration: a Ray Serve config file whose application `args` are an `AppConfig`.

The same YAML file is read by `specserve serve --config FILE`, by `serve run FILE` / `serve deploy FILE` (its
`import_path` is `specserve.cluster.serve.serve_app:build_app`, which validates `args` into an AppConfig) and is
embedded as a RayService's `serveConfigV2`, so there is no second copy to drift.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, Field, model_validator

from specserve.cluster.speculative_config import apply_speculative_config
from specserve.protos.wire import APP_NAME
from specserve.workers.config.request import MAX_K
from specserve.workers.config.settings import BatchingConfig, KVCacheConfig, NgramConfig
from specserve.workers.config.strict import StrictModel, validate
from specserve.workers.errors import InvalidRequestError

DEMO = "demo"  # a model path of "demo" means the demo family (built on first use)
# A known name (workers/models/known_models.json): pulled and converted on first use.
DEFAULT_MODEL = "smollm2-135m-instruct"
DRAFT_POOL_CPUS = 0.5  # a draft pool replica's CPUs unless set (its drafting is a fraction of a target step)
IMPORT_PATH = "specserve.cluster.serve.serve_app:build_app"
AUTOSCALING_POLICY = "specserve.cluster.scheduling.autoscaling:PoolAutoscalingPolicy"
# The generated add_SpecServeServicer_to_server, its deserializer never raising (INVALID_ARGUMENT, not UNKNOWN).
GRPC_SERVICER = "specserve.cluster.serve.public_proto.add_servicer_to_server"
# The standard grpc.health.v1 service, answered by the ingress (cluster/serve/health.py).
HEALTH_SERVICER = "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server"


class AutoscalingConfig(StrictModel):
    """Ray Serve's autoscaling_config for one pool (the fields specserve sets; Serve validates the rest)."""

    min_replicas: int = Field(1, ge=0, description="Fewest replicas.")
    max_replicas: int = Field(1, gt=0, description="Most replicas.")
    target_ongoing_requests: float = Field(4.0, gt=0, description="Ongoing requests per replica Serve aims for.")
    upscale_delay_s: float = Field(10.0, ge=0, description="Sustained demand before adding replicas.")
    downscale_delay_s: float = Field(120.0, ge=0, description="Sustained idleness before removing replicas.")
    metrics_interval_s: float = Field(10.0, gt=0, description="How often replicas report autoscaling metrics.")
    look_back_period_s: float = Field(30.0, gt=0, description="Window the reported metrics are averaged over.")

    @model_validator(mode="after")
    def _bounds(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        return self


class WorkerPoolConfig(StrictModel):
    """One pool of model workers (a Serve deployment)."""

    replicas: int = Field(1, gt=0, le=1024, description="Fixed replica count (ignored when autoscaling is set).")
    autoscaling: AutoscalingConfig | None = Field(None, description="Scale the pool with load instead.")
    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved per replica.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs reserved per replica (0 on CPU machines).")
    threads: Annotated[int, Field(gt=0, le=1024)] | Literal["auto"] = Field(
        "auto", description="torch CPU threads per worker (per rank); auto: a CPU target pool's workers use every "
        "CPU of their container but one (split between tensor-parallel ranks), since num_cpus only places them; draft "
        "workers use their reserved CPUs (at least 1). Set it when several target replicas share one machine."
    )  # fmt: skip
    cpu_binding: Literal["auto", "off"] = Field(
        "auto", description="On a CPU machine, auto: the worker of a target pool of one replica and one rank with "
        "threads auto runs on every CPU of its container but the first, which the serving processes keep "
        "(workers/runtime/threads.py); off: the kernel places it. Several models in one app: off."
    )  # fmt: skip
    resources: dict[str, float] = Field(
        default_factory=dict, description="Ray custom resources per replica, e.g. {target_gpu: 1} on KubeRay."
    )
    tensor_parallel_size: int = Field(
        1, gt=0, le=64, description="Ranks per replica: N Ray actors in one STRICT_PACK placement group (one bundle "
        "of this pool's CPUs/GPUs/resources per rank), sharding the model with transformers' tensor parallelism."
    )  # fmt: skip
    kv_cache: KVCacheConfig = Field(default_factory=KVCacheConfig, description="KV cache capacity per replica.")
    batching: BatchingConfig = Field(default_factory=BatchingConfig, description="Continuous batching per replica.")


def binds_cpus(pool: WorkerPoolConfig, device: str) -> bool:
    """Whether a target pool's worker is bound to its own CPUs (`cpu_binding`): one replica, one rank, on a CPU."""
    return (device == "cpu" and pool.cpu_binding == "auto" and pool.threads == "auto" and pool.autoscaling is None
            and pool.replicas == 1 and pool.tensor_parallel_size == 1)  # fmt: skip


class ModelPairConfig(StrictModel):
    """One served model: a target and how it is drafted for."""

    name: str = Field(
        DEFAULT_MODEL, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$",
        description="Served name (the `model` of requests, /v1/models, logs and metrics).",
    )  # fmt: skip
    target: str = Field(
        DEFAULT_MODEL, min_length=1, description="Target model: a known name (`specserve models list`), a .gguf file "
        "(converted once, cached by its sha256), a Hugging Face directory, a Hugging Face repo id org/name[@revision] "
        "(downloaded into the Hugging Face cache; HF_HUB_OFFLINE=1 reads the cache only), or 'demo' for the demo "
        "family."
    )  # fmt: skip
    draft: str = Field(
        min_length=1,
        description=(
            "Draft model (name, .gguf file, directory or repo id), an EAGLE-3 head directory or 'eagle' (the "
            "head packaged for the target; methods 'eagle-tree+ngram', the default, 'eagle+ngram' and the rest: the "
            "draft pool runs the head, the target pool captures the features it reads), 'ngram' (prompt lookup),"
            " 'none', or 'demo' (the demo family's draft, with target 'demo'). Unset: 'eagle' when a head is packaged"
            " for the target, else 'ngram'."
        ),
    )
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "auto", description="Model dtype; auto: bfloat16 on CUDA, float32 on a CPU (as vLLM's auto)."
    )
    device: Literal["cpu", "cuda", "auto"] = Field("auto", description="auto = cuda when available, else cpu.")
    enforce_eager: bool = Field(
        False, description="On CUDA, no CUDA graphs: every forward pass eager (vLLM's enforce_eager)."
    )  # fmt: skip
    k: int | Literal["auto"] = Field(
        "auto", description=f"Default tokens drafted per round (1..{MAX_K}), or 'auto': the goodput planner's, per "
        "request and round, from the workers' measured costs and the request's acceptance (0 where drafting does "
        "not pay, as under heavy load)."
    )  # fmt: skip
    max_k: int | None = Field(
        None, ge=1, le=MAX_K, description="The most tokens k='auto' drafts a round (vLLM's num_speculative_tokens); "
        "unset: the planner's own caps (8 for chains, 16 tree nodes)."
    )  # fmt: skip
    ngram: NgramConfig = Field(default_factory=NgramConfig, description="Prompt lookup's n-gram sizes.")
    predraft: bool = Field(True, description="Draft round r + 1 while round r verifies.")
    prefill_chunk_tokens: int | None = Field(
        256, ge=16, description="A prompt longer than this prefills in chunks of it, each its own target call, so a "
        "long prompt shares the target with the other requests' rounds instead of stalling them (vLLM's chunked "
        "prefill, max_num_batched_tokens). A chunk over a cached prefix computes nothing it holds. None: one call. "
        "Beside 4 chat streams a 4K-token prompt kept their p99 gap at 6.8 s chunked, 32 s in one call; its own "
        "time to first token was 3.8x its time alone, 1.5x in one call."
    )  # fmt: skip
    decode_steps: int = Field(
        32, ge=1, le=1024, description="Speculation off (method 'none'): the most decoding steps a target worker runs "
        "in one call, each token streamed back while the next step runs (vLLM V0's num_scheduler_steps). 1: one each."
    )  # fmt: skip
    target_pool: WorkerPoolConfig = Field(default_factory=WorkerPoolConfig, description="Target workers.")
    draft_pool: WorkerPoolConfig = Field(
        default_factory=lambda: WorkerPoolConfig(num_cpus=DRAFT_POOL_CPUS),
        description="Draft workers (unused for ngram/none).",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_draft(cls, data: Any) -> Any:
        """vLLM's `speculative_config` translated into these fields (cluster/speculative_config.py); then an unset (or
        null) draft: the target's packaged head if any, else n-gram, decided once, here, so that every replica reads
        the same answer from the dumped config (which has no speculative_config left)."""
        if isinstance(data, dict) and "speculative_config" in data:
            data = dict(data)
            data = apply_speculative_config(data, data.pop("speculative_config"))
        if isinstance(data, dict) and data.get("draft") is None:
            target = data.get("target", DEFAULT_MODEL)
            data = {**data, "draft": default_draft(target) if isinstance(target, str) else "ngram"}
        return data

    @model_validator(mode="before")
    @classmethod
    def _share_one_gpu(cls, data: Any) -> Any:
        """device 'cuda' with a pool's num_gpus unset: the pools share one GPU (target 0.5, draft 0.25, as Ray's
        fractional GPUs; a tensor-parallel target takes one a rank, since NCCL refuses two ranks on one device), and
        each worker's gpu_memory_utilization, unless set, is 0.9 of its share (vLLM's is per instance: two workers
        at 0.9 of one GPU would each budget for most of it)."""
        if not isinstance(data, dict) or data.get("device") != "cuda":
            return data
        data = dict(data)
        for key, share in (("target_pool", 0.5), ("draft_pool", 0.25)):
            pool = data.get(key) or {}
            pool = pool.model_dump(exclude_unset=True) if isinstance(pool, BaseModel) else dict(pool)
            if key == "draft_pool" and "num_cpus" not in pool:
                pool["num_cpus"] = DRAFT_POOL_CPUS
            if "num_gpus" not in pool:
                pool["num_gpus"] = 1.0 if pool.get("tensor_parallel_size", 1) > 1 else share
                kv = pool.get("kv_cache") or {}
                kv = kv.model_dump(exclude_unset=True) if isinstance(kv, BaseModel) else dict(kv)
                kv.setdefault("gpu_memory_utilization", round(0.9 * pool["num_gpus"], 4))
                pool["kv_cache"] = kv
            data[key] = pool
        return data

    @model_validator(mode="after")
    def _k(self):
        if self.k != "auto" and not 1 <= self.k <= MAX_K:
            raise ValueError(f"k must be 1..{MAX_K} or 'auto', got {self.k}")
        if self.draft == DEMO and self.target != DEMO:
            raise ValueError("draft 'demo' (the demo family's draft) drafts only for target 'demo'")
        return self

    @property
    def drafts_with_model(self) -> bool:
        """A draft pool runs for the model: a draft model or an EAGLE-3 head."""
        return self.draft not in ("ngram", "none")


def default_draft(target: str) -> str:
    """'eagle' when an EAGLE-3 head that pays (its measured acceptance) is packaged for `target`, else 'ngram'. Cheap: a
    known name's identity is its GGUF file's pinned sha256 (nothing is pulled), a converted directory's is in its
    marker, a .gguf file is hashed; other targets are not looked up (workers/models/packaged_heads.py)."""
    from specserve.workers.models.catalog import known_models
    from specserve.workers.models.packaged_heads import PACKAGED, packaged_head_for, packaged_heads, pays

    if target == DEMO:
        return "ngram"
    known = known_models().get(target)
    head = packaged_heads().get(known.gguf_sha256) if known is not None else packaged_head_for(target)
    return PACKAGED if head is not None and pays(head) else "ngram"


def demo_model() -> ModelPairConfig:
    """The demo family (5M toy target and its trained draft, packaged with specserve: offline, seconds to start)."""
    return ModelPairConfig(name=DEMO, target=DEMO, draft=DEMO)


class LimitsConfig(StrictModel):
    """Per-request limits, enforced at the ingress before any model work."""

    max_prompt_tokens: int = Field(
        8192, gt=0, description="Longest prompt accepted, in tokens (and never more than the model's context less "
        "one). A longer prompt is refused by its length in characters before it is tokenized when it cannot fit."
    )  # fmt: skip
    max_new_tokens: int | None = Field(
        None, gt=0, le=1_000_000, description="Largest max_new_tokens a request may ask for (OpenAI's max_tokens); "
        "None (the default, as vLLM): no cap but the model's context."
    )  # fmt: skip
    default_max_new_tokens: int | None = Field(
        None, gt=0, le=1_000_000, description="max_new_tokens when a request does not say. None (the default, as "
        "vLLM): up to the context's end after the prompt (or EOS), within max_new_tokens and the model's "
        "generation_config.json max_new_tokens when set; a number: at most that, lowered to what fits (so an unset "
        "max_new_tokens is never an error)."
    )  # fmt: skip
    max_stop_sequences: int = Field(16, ge=0, le=64, description="Most stop sequences a request may send.")
    max_stop_chars: int = Field(256, gt=0, le=1024, description="Longest stop sequence, in characters.")
    max_request_bytes: int = Field(
        4 * 1024 * 1024, gt=0, description="Largest HTTP request body accepted (413 above it)."
    )
    max_grpc_message_bytes: int = Field(
        4 * 1024 * 1024, gt=0, le=2**31 - 1, description="Largest gRPC message Serve's gRPC proxy accepts "
        "(RESOURCE_EXHAUSTED above it, refused before it is buffered). Worker gRPC servers take at least this, and "
        "more when the token limits need it. `specserve serve` and the KubeRay manifests apply it to the proxy "
        "(RAY_SERVE_GRPC_MAX_MESSAGE_SIZE); under `serve run`/`serve deploy` set that variable yourself."
    )  # fmt: skip


REFUSAL_ROOM = 64  # requests past a replica's queue that Serve still routes to it, to be answered 429 at once


class SchedulerDeploymentConfig(StrictModel):
    """The scheduler deployment (and the ingress deployment in front of it, which has as many replicas)."""

    replicas: int = Field(1, gt=0, le=64, description="Scheduler replicas (and as many ingress replicas, which "
                          "hold no state and reserve no CPU).")  # fmt: skip
    num_cpus: float = Field(0.5, ge=0, description="CPUs reserved per scheduler replica.")
    max_ongoing_requests: int | None = Field(
        None, gt=0, description="Requests Serve routes to one ingress or scheduler replica. None (the default): "
        "derived from max_active_requests + max_queued_requests, with room for the refusals past them, so that no "
        "request waits in Serve's own queues, where status() and the metrics cannot see it."
    )  # fmt: skip
    max_active_requests: int = Field(
        128, gt=0, description="Requests one scheduler replica runs at once; more wait in its queue (in arrival order)."
    )  # fmt: skip
    max_queued_requests: int = Field(
        4096, ge=0, description="Requests one scheduler replica holds waiting beyond max_active_requests; past it "
        "RESOURCE_EXHAUSTED / 429 with Retry-After. Queued requests hold only their prompt's token ids."
    )  # fmt: skip

    @property
    def serve_max_ongoing_requests(self) -> int:
        """What Serve routes to a replica: the queue's bound and room for answering 429 past it."""
        bound = self.max_active_requests + self.max_queued_requests + REFUSAL_ROOM
        return self.max_ongoing_requests or bound

    call_timeout_s: float = Field(
        60.0, gt=0, description="Within it a worker that stopped answering is known to be down: a scheduler -> worker "
        "call unanswered for a third of it asks the worker's health check (answered off the model thread), which must "
        "answer within half of it. A live worker's long calls (a prompt near the context limit) are waited for."
    )  # fmt: skip
    max_call_s: float = Field(
        3600.0, gt=0, description="The longest a scheduler -> worker call may run while its worker answers its health "
        "check (a model thread stuck in a live process)."
    )  # fmt: skip
    drain_timeout_s: float = Field(
        60.0, ge=0, description="On a stop (SIGTERM, `specserve drain`, a scheduler or ingress replica's shutdown): "
        "how long running requests may finish while no new one is admitted (503 / UNAVAILABLE, retry). The "
        "manifests' terminationGracePeriodSeconds leaves room for it."
    )  # fmt: skip
    worker_wait_s: float = Field(
        600.0, gt=0, description="How long a request waits for the pools to come up, or for a healthy target worker "
        "after its own failed (the failed one rejoins when it answers again)."
    )  # fmt: skip


class AuthConfig(StrictModel):
    """Who may call the public endpoints."""

    api_key_env: str | None = Field(
        "SPECSERVE_API_KEY", min_length=1, description="Environment variable holding the API key. When it is set "
        "(non-empty) on the ingress, gRPC and HTTP calls need 'authorization: Bearer <key>' (UNAUTHENTICATED / 401 "
        "otherwise); keys never go in this file. None: no API key, whatever the environment says."
    )  # fmt: skip


class HttpConfig(StrictModel):
    """The OpenAI-compatible HTTP API's leniency."""

    strict: bool = Field(
        False, description="Refuse unknown request fields with 400 naming them. False (the default, as vLLM): they "
        "are ignored and named in the log (a WARNING, rate-limited); the request's size and value bounds hold either "
        "way."
    )  # fmt: skip


class AppConfig(StrictModel):
    """Everything `build_app` needs: the served models, their pools, limits and the scheduler deployment."""

    models: list[ModelPairConfig] = Field(default_factory=lambda: [ModelPairConfig()], min_length=1)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    scheduler: SchedulerDeploymentConfig = Field(default_factory=SchedulerDeploymentConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    http: HttpConfig = Field(default_factory=HttpConfig)
    autoscaling_goal_busy_fraction: float = Field(
        0.7, gt=0, le=1, description="Busy fraction the pool autoscaling policy sizes each pool's replicas for."
    )

    @model_validator(mode="before")
    @classmethod
    def _old_key(cls, data: Any) -> Any:
        """`ingress:`, the scheduler deployment's key before it was named for what it configures, still read (config
        files and RayServices in the wild carry it); never written."""
        if isinstance(data, dict) and "ingress" in data:
            if "scheduler" in data:
                raise ValueError("give 'scheduler' only ('ingress' is its old name)")
            data = {("scheduler" if key == "ingress" else key): value for key, value in data.items()}
        return data

    @model_validator(mode="after")
    def _unique(self):
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        return self

    def model(self, name: str) -> ModelPairConfig:
        """The named model, the first one for an empty name."""
        if not name:
            return self.models[0]
        for m in self.models:
            if m.name == name:
                return m
        raise InvalidRequestError("model", f"unknown model {name!r}; served: {', '.join(m.name for m in self.models)}")


def serve_config(
    app: AppConfig | None = None, grpc_port: int = 9000, http_port: int = 8000, http_host: str = "127.0.0.1"
) -> dict[str, Any]:
    """A Ray Serve config file (ServeDeploySchema) running specserve with `app` as its args. `http_host` is where
    `specserve serve` binds the HTTP proxy and the gRPC proxy (Serve's gRPC options have no host): localhost by
    default; a cluster deployment (RayService) sets 0.0.0.0 and requires an API key."""
    app = app or AppConfig()
    application: dict[str, Any] = {
        "name": APP_NAME,
        "route_prefix": "/",
        "import_path": IMPORT_PATH,
        "args": app.model_dump(mode="json"),
    }
    if any(p.autoscaling for m in app.models for p in (m.target_pool, m.draft_pool)):
        # Scale each model's draft and target pools together by their busy time (cluster/scheduling/autoscaling.py).
        application["autoscaling_policy"] = {
            "policy_function": AUTOSCALING_POLICY,
            "policy_kwargs": {"goal_busy_fraction": app.autoscaling_goal_busy_fraction},
        }
    return {
        # A proxy on every node with a replica: KubeRay's worker readiness probes expect one (kuberay #4994).
        "proxy_location": "EveryNode",
        "http_options": {"host": http_host, "port": http_port},
        "grpc_options": {"port": grpc_port, "grpc_servicer_functions": [GRPC_SERVICER, HEALTH_SERVICER]},
        "applications": [application],
    }


def load_serve_config(path: str | Path) -> dict[str, Any]:
    """Read a Serve config file and validate specserve's application args in it (clear errors, not tracebacks)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise InvalidRequestError("config", f"cannot read {path}: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("applications"), list):
        raise InvalidRequestError("config", f"{path} is not a Ray Serve config file (no 'applications' list)")
    apps = [a for a in data["applications"] if isinstance(a, dict) and a.get("import_path") == IMPORT_PATH]
    if len(apps) != 1:
        raise InvalidRequestError("config", f"{path} must have exactly one application with import_path {IMPORT_PATH}")
    app_config(apps[0].get("args") or {})
    return data


def app_config(args: dict[str, Any] | AppConfig) -> AppConfig:
    if isinstance(args, AppConfig):
        return args
    return validate(AppConfig, args)
