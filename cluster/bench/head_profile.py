"""Where an EAGLE-3 head's drafting time goes, per dtype: the GPU check's `head-profile` step.

On the H200 (2026-12-04, results/2026-12-04-1718-h200-gpu-check) the packaged SmolLM2 head drafted 13.2 ms a token in
bf16 against 1.9 ms in fp32, on the same GPU and code: more than kernel launches, which fp32 makes as many of. This
times the head alone (its embedding, no target) and records torch.profiler's busiest operators for a chain and for a
tree, bf16 then fp32, so the next run on a GPU says which operator it is.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

import torch
from torch.profiler import ProfilerActivity, profile

from specserve.workers.config.request import SamplingParams
from specserve.workers.models.catalog import resolve_model
from specserve.workers.models.packaged_heads import packaged_head_for
from specserve.workers.runtime.cost_probe import probe_tokens
from specserve.workers.speculation.draft_tree import TreeShape
from specserve.workers.speculation.eagle.loading import load_head_drafter
from specserve.workers.speculation.planner.drafter_costs import head_cost

CONTEXT = 256  # committed positions before the profiled drafting: a chat's
TOP = 20  # operators kept per profile


def _top(prof, cuda: bool) -> list[dict]:
    """The busiest operators of a profile, by their own device time on a GPU (host time on a CPU)."""
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)[:TOP]
    return [
        {
            "op": e.key,
            "calls": e.count,
            "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
            "self_device_ms": round(getattr(e, "self_device_time_total", 0.0) / 1e3, 3),
        }
        for e in events
    ]


def profile_drafter(drafter, device: str, k: int = 8, reps: int = 3) -> dict:
    """One dtype's figures: the fitted cost (the planner's), then a chain of k and a 16-node tree, timed and profiled
    `reps` times each after a warm-up."""
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cost = head_cost(drafter, CONTEXT, k)
    request_id = f"head-profile-{uuid.uuid4().hex}"
    tokens = probe_tokens(CONTEXT + 1, drafter.head.config.vocab_size)
    drafter.add_features(request_id, 0, torch.zeros(CONTEXT, 3 * drafter.head.config.target_hidden_size))
    # every level drafted: the probe's zero features leave the head unsure, and the default shape stops drafting
    # paths below its least probability
    params = SamplingParams(max_new_tokens=k, temperature=0.0)
    shape = dataclasses.replace(TreeShape.for_budget(16), min_path_prob=0.0)
    result: dict = {"fixed_ms": 1e3 * cost.fixed_s, "step_ms": 1e3 * cost.step_s}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        for name, draft in (("chain", lambda: drafter.propose(request_id, tokens, k, params)),
                            ("tree", lambda: drafter.propose_tree(request_id, tokens, shape))):  # fmt: skip
            draft()  # warm-up (the first call extends the head's cache over the context)
            sync()
            t0 = time.perf_counter()
            for _ in range(reps):
                draft()
            sync()
            result[f"{name}_ms"] = 1e3 * (time.perf_counter() - t0) / reps
            with profile(activities=activities) as prof:
                for _ in range(reps):
                    draft()
                sync()
            result[f"{name}_top"] = _top(prof, cuda)
    finally:
        drafter.release(request_id)
    return result


def placement(drafter) -> dict:
    """Where the drafter's tensors are and in what dtype: {what: "device dtype"} (a tensor left on the host would
    run its products there)."""
    seen: dict[str, str] = {}
    tensors = [
        *drafter.head.named_parameters(),
        *drafter.head.named_buffers(),
        ("embedding", drafter.drafting.embed_weight),
    ]
    for name, tensor in tensors:
        seen.setdefault(f"{tensor.device} {tensor.dtype}", name)
    return {where: f"e.g. {name}" for where, name in seen.items()}


def head_profile(model: str, device: str, out: str) -> None:
    """Profile the model's packaged head in each dtype the device runs (bf16 and fp32 on CUDA): alone (as a draft
    worker loads it), alone with its tree levels eager, alone at one CPU thread, and beside its target in one process
    (as the in-process engine does: on 2026-12-04 the served draft worker's bf16 trees took ~8.5 ms a round where the
    in-process probe said 13 ms a token); JSON into `out`."""
    from specserve.workers.config.settings import ModelConfig
    from specserve.workers.runtime.loading import load_model
    from specserve.workers.speculation.engine import SpecEngine

    target_path = resolve_model(model, progress=False)
    head = packaged_head_for(target_path)
    if head is None:
        raise SystemExit(f"no packaged EAGLE-3 head for {model}")
    torch.set_grad_enabled(False)
    result: dict = {"model": model, "device": device, "context": CONTEXT}
    for dtype in ("bfloat16", "float32") if device == "cuda" else ("float32",):
        threads = torch.get_num_threads()
        for setup in ("alone", "alone-eager", "alone-1-thread", "alone-no-cudnn-attention", "beside-target"):
            target = None
            # a draft worker runs on its few CPU threads (workers/runtime/threads.py), a bench on every core
            torch.set_num_threads(1 if setup == "alone-1-thread" else threads)
            if setup.startswith("alone"):
                eager = setup == "alone-eager"  # the tree levels without their CUDA graphs (eagle/graphs.py)
                drafter = load_head_drafter(head, target_path, dtype=dtype, device=device, enforce_eager=eager)
            else:  # the in-process engine as the bench builds it: its target runner, arena and graphs beside
                target = SpecEngine(load_model(ModelConfig(path=str(target_path), device=device, dtype=dtype)),
                                    eagle_head=head)  # fmt: skip
                drafter = target.drafters["eagle"]
            # cuDNN's attention plans each new shape (a chain's keys grow a step at a time): the same without it
            cudnn = torch.backends.cuda.cudnn_sdp_enabled()
            torch.backends.cuda.enable_cudnn_sdp(cudnn and setup != "alone-no-cudnn-attention")
            try:
                entry = profile_drafter(drafter, device)
            finally:
                torch.backends.cuda.enable_cudnn_sdp(cudnn)
            entry["placement"], entry["threads"] = placement(drafter), torch.get_num_threads()
            if device == "cuda":  # memory pressure slows every allocation (the caching allocator frees and retries)
                free, total = torch.cuda.mem_get_info()
                entry["gpu_gib"] = {"free": free / 2**30, "total": total / 2**30,
                                    "reserved": torch.cuda.memory_reserved() / 2**30}  # fmt: skip
            result[f"{dtype} {setup}"] = entry
            figures = {key: round(value, 2) for key, value in entry.items() if key.endswith("_ms")}
            print(f"head {dtype} {setup}: {figures}; tensors: {entry['placement']}; {entry.get('gpu_gib')}", flush=True)
            for part in ("chain", "tree"):
                for op in entry[f"{part}_top"][:6]:
                    print(f"  {part}  {op}", flush=True)
            del drafter, target
            if device == "cuda":
                torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
