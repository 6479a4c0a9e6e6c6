"""The disaggregated rows of `specserve bench`: the same prompts through draft and target worker actors on a local
Ray cluster, driven by the scheduler actor over gRPC, and through the Serve application (cluster/bench/serve.py),
each placed next to the in-process row it compares with."""

from __future__ import annotations

import time

from specserve.cluster.bench.rows import SAMPLED_NGRAM_K, BenchConfig, Row, best_draft_k
from specserve.cluster.bench.serve import serve_rows
from specserve.cluster.bench.timing import finish_stream_rows


def distributed_rows(target_path: str, draft_path: str | None, prompts: list[list[int]], cfg: BenchConfig, k: int,
                     device: str, base: Row, method: str = "draft") -> tuple[list[Row], dict]:  # fmt: skip
    """The disaggregated path on a local Ray cluster: a draft worker actor (none for n-gram drafting, which runs in
    the scheduler) and a target worker actor over gRPC, driven by the scheduler actor. One stream (within-request
    pipelining only) and all prompts at once."""
    import ray

    from specserve.cluster.config import local_config
    from specserve.cluster.pools.builders import deploy

    started = not ray.is_initialized()
    if started:
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    deployment = deploy(local_config(target_path, draft_path, device=device))
    sampling, spec = {"max_new_tokens": cfg.max_new_tokens}, {"method": method, "k": k}
    what = f"{'ngram ' if method == 'ngram' else ''}k={k}"
    try:
        ray.get(deployment.scheduler.generate.remote(prompts[0][:16], {"max_new_tokens": 4}, spec))  # warm-up
        one = Row(f"disaggregated {what} greedy, 1 stream", "disaggregated", k, 0.0)
        for prompt in prompts:
            t0 = time.perf_counter()
            out = ray.get(deployment.scheduler.generate.remote(prompt, sampling, spec))
            one.seconds += time.perf_counter() - t0
            one.outputs.append(out["token_ids"])
        many = Row(f"disaggregated {what} greedy, {len(prompts)} streams", "disaggregated", k, 0.0)
        t0 = time.perf_counter()
        outs = ray.get([deployment.scheduler.generate.remote(p, sampling, spec) for p in prompts])
        many.seconds = time.perf_counter() - t0
        many.outputs = [o["token_ids"] for o in outs]
        status = ray.get(deployment.scheduler.status.remote())
    finally:
        deployment.shutdown()
        if started:
            ray.shutdown()
    return finish_stream_rows([one, many], base), status


def add_distributed(rows: list[Row], meta: dict, target_path: str, draft_path: str | None, prompts: list[list[int]],
                    cfg: BenchConfig, device: str) -> None:  # fmt: skip
    """The disaggregated and Serve rows, next to the in-process row they compare with (draft k=4, or n-gram k=4)."""
    method, k = ("draft", best_draft_k(cfg)) if draft_path else ("ngram", SAMPLED_NGRAM_K)
    in_process = next(r for r in rows if r.method == method and r.k == k and r.temperature == 0)
    extra, status = distributed_rows(target_path, draft_path, prompts, cfg, k, device, rows[0], method)
    rows[rows.index(in_process) + 1 : rows.index(in_process) + 1] = extra
    meta["disaggregated"] = {
        "vs_in_process_1_stream": extra[0].tokens_per_s / in_process.tokens_per_s,
        "vs_in_process_all_streams": extra[1].tokens_per_s / in_process.tokens_per_s,
        "orchestration_ms_p50": status["orchestration_ms_p50"],
        "wire_bytes_per_round": status["wire_bytes_per_round"],
    }
    # A Serve model whose draft is 'ngram' drafts by prompt lookup by default
    served = serve_rows(target_path, draft_path or "ngram", prompts, cfg, k, device, rows[0])
    if not draft_path:
        for row in served:
            row.name = row.name.replace(f"k={k}", f"ngram k={k}", 1)
    at = rows.index(extra[-1]) + 1
    rows[at:at] = served
    meta["disaggregated"]["serve_vs_in_process_1_stream"] = served[0].tokens_per_s / in_process.tokens_per_s
