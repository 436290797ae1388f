"""``unit.common`` shim: DistributedTest as a plain base class (world size 1, in-process).

DeepSpeed's real DistributedTest launches worker processes and a process
group; the DeepNVMe tests use world_size = 1 and no collectives, so running
the methods directly in the pytest process tests the same handle calls.
"""


class DistributedTest:
    world_size = 1
    reuse_dist_env = False
    requires_cuda_env = True
    init_distributed = True
    set_dist_env = True
