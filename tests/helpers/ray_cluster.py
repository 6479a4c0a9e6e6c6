"""A multi-node Ray cluster on this machine (ray.cluster_utils.Cluster) for placement tests: a head, a "cheap GPU"
node offering draft_gpu and a "big GPU" node offering target_gpu."""

import logging


def start_cluster(attempts: int = 3):
    """(cluster, draft node, target node). Ray gives each raylet a fixed 30 s to register; on 2 busy cores (the rest of
    the suite's processes winding down) a node can miss it. That is the machine, not specserve: start the cluster
    again."""
    from ray.cluster_utils import Cluster

    for attempt in range(attempts):
        c = Cluster(initialize_head=False)
        try:
            c.add_node(num_cpus=1, include_dashboard=False)
            draft_node = c.add_node(num_cpus=1, resources={"draft_gpu": 1})
            target_node = c.add_node(num_cpus=2, resources={"target_gpu": 2})
            return c, draft_node, target_node
        except Exception as err:  # noqa: BLE001  (Ray raises a bare Exception for this timeout)
            c.shutdown()
            if "timed out during startup" not in str(err) or attempt == attempts - 1:
                raise
            logging.getLogger(__name__).warning("Ray node start timed out (attempt %d): starting again", attempt + 1)
    raise AssertionError("unreachable")
