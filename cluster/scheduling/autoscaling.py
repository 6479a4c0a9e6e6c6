"""The pools' Serve autoscaling policy, named by its import path in the Serve config
(`autoscaling_policy.policy_function`: `specserve.cluster.scheduling.autoscaling:PoolAutoscalingPolicy`).

Pool replicas report `busy_fraction` (time computing) through Serve's `record_autoscaling_stats`. The policy sizes
each model's target pool to its busy time, and its draft pool to the target demand times the measured draft/target
busy-time ratio, so draft replicas follow the target's demand. Serve's controller imports this module: it imports
nothing heavier than `math`.
"""

from __future__ import annotations

import logging
import math

log = logging.getLogger(__name__)


def _busy(ctx) -> float:
    """Sum of the replicas' busy fractions (replica-equivalents of work) from the aggregated custom metric."""
    per_replica = (ctx.aggregated_metrics or {}).get("busy_fraction") or {}
    return float(sum(per_replica.values()))


def pool_sizes(target_busy: float, draft_busy: float | None, goal: float) -> tuple[int, int | None]:
    """(target replicas, draft replicas or None) so that each replica is busy `goal` of the time on average.
    Drafts follow the target: the draft work per unit of target work (the measured busy ratio) times the target pool
    that is being asked for, so a saturated target pool that grows brings its drafts along."""
    targets = max(1, math.ceil(target_busy / goal - 1e-9))
    if draft_busy is None:
        return targets, None
    ratio = draft_busy / target_busy if target_busy > 0 else 0.0
    drafts = max(1, math.ceil(max(draft_busy / goal, ratio * targets) - 1e-9))
    return targets, drafts


class PoolAutoscalingPolicy:
    """Serve application-level autoscaling policy (`autoscaling_policy.policy_function` in the Serve config):
    scales every model's `target-<model>` and `draft-<model>` deployments together."""

    def __init__(self, goal_busy_fraction: float = 0.7):
        if not 0 < goal_busy_fraction <= 1:
            raise ValueError(f"goal_busy_fraction must be in (0, 1], got {goal_busy_fraction}")
        self.goal = goal_busy_fraction

    def __call__(self, contexts: dict) -> tuple[dict, dict]:
        by_name = {ctx.deployment_name: (dep_id, ctx) for dep_id, ctx in contexts.items()}
        decisions: dict = {}
        for name, (dep_id, ctx) in by_name.items():
            if not name.startswith("target-"):
                continue
            draft = by_name.get("draft-" + name[len("target-") :])
            targets, drafts = pool_sizes(_busy(ctx), _busy(draft[1]) if draft else None, self.goal)
            decisions[dep_id] = targets
            if draft is not None:
                decisions[draft[0]] = drafts
            log.debug("pools of %s: %d target replicas, %s draft replicas", name[len("target-") :], targets, drafts)
        return decisions, {}
