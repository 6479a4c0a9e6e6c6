"""The planner: what each round drafts (whose chain, how long, or a tree's nodes), from measured costs and
acceptance; one `RoundPlan` a round, for the scheduler and the in-process engine alike (docs/planner.md)."""
