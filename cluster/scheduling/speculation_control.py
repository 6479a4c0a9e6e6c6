"""One model's speculation control: after every round of every request, the recent acceptance, the k policy and the
measured switch set the scheduler's cap on k for k='auto' requests (`Scheduler.auto_k_cap`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from specserve.cluster.scheduling.k_policy import AcceptanceHistory, SpeculationPolicy, target_utilisation
from specserve.cluster.scheduling.pipeline import Pipeline
from specserve.cluster.scheduling.switch import SpeculationSwitch

log = logging.getLogger(__name__)


def update_speculation(
    pipeline: Pipeline,
    acceptance: AcceptanceHistory,
    policy: SpeculationPolicy,
    cost_ratio: float,
    saturation_requests: int | None,
    switch: SpeculationSwitch | None = None,
) -> None:
    """Set the pipeline's cap on k for k='auto' requests: the policy's k for the recent acceptance, the draft cost
    ratio and the target pool's utilisation (from `saturation_requests` when configured, else measured), turned
    off while `switch` measures speculation losing."""
    a = acceptance.estimate()
    if a is None:
        return
    sched = pipeline.scheduler
    before = sched.auto_k_cap
    targets = len(sched.healthy("target"))
    if switch is not None:
        switch.note_load(len(sched.requests) / max(1, targets))
    if switch is not None and not switch.allow():
        sched.auto_k_cap = 0
    else:
        if saturation_requests:
            u = target_utilisation(len(sched.requests), targets, saturation_requests)
        else:
            u = pipeline.verify_costs.utilisation(len(sched.requests) / max(1, targets)) or 0.0
        # Probes of speculation draft the policy's k, not one token: with a fixed cost per drafting round (the draft
        # worker's round trip), k = 1 can lose where a larger k wins (seen at one stream, disaggregated: k = 1 no
        # faster than plain decoding, the policy's k 1.5x).
        sched.auto_k_cap = policy.update(a, cost_ratio, u)
    if sched.auto_k_cap != before:
        log.debug("k cap %s -> %d (acceptance %.3f, %d requests on %d targets)", before, sched.auto_k_cap, a,
                  len(sched.requests), targets)  # fmt: skip


@dataclass
class SpeculationControl:
    """One model's speculation state, fed after every round of every request: recent acceptance, the policy's k and
    the measured switch. The Serve app keeps one per model; the bench keeps one across its concurrency levels."""

    acceptance: AcceptanceHistory = field(default_factory=AcceptanceHistory)
    policy: SpeculationPolicy = field(default_factory=SpeculationPolicy)
    switch: SpeculationSwitch = field(default_factory=SpeculationSwitch)

    def after_round(
        self, drafted: int, accepted: int, committed: int, seconds: float, request_s: float | None = None
    ) -> None:
        """One round of a request; `request_s`: the request's duration when the round was its last."""
        self.acceptance.observe(drafted, accepted)
        if request_s is not None:
            self.switch.request_finished(request_s)
        # First rounds count too: they prefill the prompt, on the target in either mode and also on the draft worker
        # while speculating, a cost of that mode like any other. Left out, they rated speculation's few rounds per
        # request (about 8 for 32 tokens, against plain decoding's 32) as faster than the streams got them: in one
        # sweep, measured 1.2-1.4x at 4-16 streams where the segments ran 0.96-1.04x.
        self.switch.observe(committed, seconds, drafted > 0)

    def apply(self, pipeline: Pipeline, cost_ratio: float, saturation_requests: int | None) -> None:
        update_speculation(pipeline, self.acceptance, self.policy, cost_ratio, saturation_requests, self.switch)
