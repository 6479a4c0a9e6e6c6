"""The Serve application's config: pools of tensor-parallel target replicas (validated degrees and the Serve deployment
options they become, one STRICT_PACK bundle per rank) and the scheduler deployment's key."""

import pytest

from specserve.cluster.app_config import app_config
from specserve.cluster.serve.serve_app import _pool_options
from specserve.workers.errors import InvalidRequestError


def _model(tp: int, **pool) -> dict:
    return {"models": [{"name": "m", "target_pool": {"tensor_parallel_size": tp, **pool}}]}


def test_a_tensor_parallel_pool_asks_for_one_packed_bundle_per_rank():
    cfg = app_config(_model(4, num_cpus=2, num_gpus=1, resources={"target_gpu": 1}))
    options = _pool_options("target-m", cfg.models[0].target_pool)
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert options["placement_group_bundles"] == [{"CPU": 2, "GPU": 1, "target_gpu": 1}] * 4
    # Rank 0 (the replica itself) fits in bundle 0.
    assert options["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 1, "resources": {"target_gpu": 1}}
    assert "placement_group_bundles" not in _pool_options("draft-m", cfg.models[0].draft_pool)


@pytest.mark.parametrize("tp", [0, 65, "two"])
def test_bad_tensor_parallel_sizes_are_rejected_naming_the_field(tp):
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size"):
        app_config(_model(tp))


def test_the_draft_pools_degree_is_its_own():
    cfg = app_config({"models": [{"name": "m", "draft_pool": {"tensor_parallel_size": 2}}]})
    model = cfg.models[0]
    assert model.target_pool.tensor_parallel_size == 1
    assert "placement_group_bundles" not in _pool_options("target-m", model.target_pool)
    assert len(_pool_options("draft-m", model.draft_pool)["placement_group_bundles"]) == 2


def test_the_scheduler_deployments_old_key_ingress_is_still_read():
    new = app_config({"models": [{"name": "m"}], "scheduler": {"replicas": 2, "call_timeout_s": 5}})
    old = app_config({"models": [{"name": "m"}], "ingress": {"replicas": 2, "call_timeout_s": 5}})
    assert old == new and new.scheduler.replicas == 2 and "ingress" not in new.model_dump()
    with pytest.raises(InvalidRequestError, match="old name"):
        app_config({"models": [{"name": "m"}], "scheduler": {}, "ingress": {}})


def test_on_cuda_the_pools_share_one_gpu_unless_told_otherwise():
    shared = app_config({"models": [{"name": "m", "device": "cuda"}]}).models[0]
    assert (shared.target_pool.num_gpus, shared.draft_pool.num_gpus) == (0.5, 0.25)
    assert shared.target_pool.num_gpus + shared.draft_pool.num_gpus <= 1
    # Each worker budgets 0.9 of its own share, not of the whole GPU the other one uses too.
    assert shared.target_pool.kv_cache.gpu_memory_utilization == pytest.approx(0.45)
    assert shared.draft_pool.kv_cache.gpu_memory_utilization == pytest.approx(0.225)
    assert shared.draft_pool.num_cpus == 0.5
    options = _pool_options("target-m", shared.target_pool)
    assert options["ray_actor_options"]["num_gpus"] == 0.5

    told = app_config(
        {
            "models": [
                {
                    "name": "m",
                    "device": "cuda",
                    "target_pool": {"num_gpus": 1, "kv_cache": {"gpu_memory_utilization": 0.8}},
                    "draft_pool": {"tensor_parallel_size": 2},
                }
            ]
        }
    )
    model = told.models[0]
    assert (model.target_pool.num_gpus, model.target_pool.kv_cache.gpu_memory_utilization) == (1, 0.8)
    assert model.draft_pool.num_gpus == 1.0  # NCCL refuses two ranks on one device

    for device in ("cpu", "auto"):
        model = app_config({"models": [{"name": "m", "device": device}]}).models[0]
        assert (model.target_pool.num_gpus, model.draft_pool.num_gpus) == (0, 0)
        assert model.target_pool.kv_cache.gpu_memory_utilization == 0.9


def test_a_lone_cpu_target_worker_is_bound_to_its_own_cpus():
    from specserve.cluster.app_config import WorkerPoolConfig, binds_cpus

    assert binds_cpus(WorkerPoolConfig(), "cpu")
    assert not binds_cpus(WorkerPoolConfig(), "cuda")
    assert not binds_cpus(WorkerPoolConfig(cpu_binding="off"), "cpu")
    assert not binds_cpus(WorkerPoolConfig(threads=2), "cpu")  # threads set by hand: placed by hand
    assert not binds_cpus(WorkerPoolConfig(replicas=2), "cpu")  # two would share the bound CPUs
    assert not binds_cpus(WorkerPoolConfig(tensor_parallel_size=2), "cpu")


def test_a_worker_body_built_outside_a_ray_actor_never_binds_its_process():
    from specserve.cluster.serve.worker_body import in_ray_actor

    assert not in_ray_actor()  # this test's process: a binding would pin it and every Ray it starts
