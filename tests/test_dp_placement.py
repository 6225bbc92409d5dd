"""Where data-parallel replicas land on GPUs, computed without GPUs: local processes (CUDA_VISIBLE_DEVICES per
replica) and Ray (one bundle per replica); asking for more GPUs than there are fails before anything starts."""
from __future__ import annotations

import os
import re
import time

import pytest

from llmcli.config import ConfigError
from llmcli.scaleout.local_pool import LocalReplicaPool, replica_gpus, visible_gpus
from llmcli.scaleout.ray_pool import RayReplicaPool, actor_resources, check_resources, replica_bundle

from processes import children_of

EIGHT = [str(i) for i in range(8)]


# -- local processes ---------------------------------------------------------------------
def test_visible_gpus_are_cudas_own_count_without_the_variable():
    assert visible_gpus(None, 4) == ["0", "1", "2", "3"]
    assert visible_gpus(None, 0) == []


def test_visible_gpus_respect_an_existing_cuda_visible_devices():
    assert visible_gpus("2,3", 8) == ["2", "3"]  # the count is CUDA's, behind the variable: not used
    assert visible_gpus(" 5 , 7,", 0) == ["5", "7"]
    assert visible_gpus("GPU-aa,GPU-bb", 0) == ["GPU-aa", "GPU-bb"]  # UUIDs pass through
    assert visible_gpus("", 8) == []  # an empty variable hides every GPU


def test_replica_r_gets_gpus_r_tp_to_r_tp_plus_tp_minus_1():
    assert replica_gpus(EIGHT, 2, 1) == ["0", "1"]
    assert replica_gpus(EIGHT, 4, 2) == ["0,1", "2,3", "4,5", "6,7"]
    assert replica_gpus(EIGHT, 2, 4) == ["0,1,2,3", "4,5,6,7"]
    assert replica_gpus(EIGHT, 1, 1) == ["0"]
    assert replica_gpus(["6", "7", "2", "3"], 2, 2) == ["6,7", "2,3"]  # the visible list's order, not sorted


@pytest.mark.parametrize("visible, size, tp, message", [
    (["0"], 2, 1, "needs 2 GPUs but 1 is visible (0)"),
    (["0", "1", "2"], 2, 2, "needs 4 GPUs but 3 are visible (0,1,2)"),
    ([], 1, 1, "needs 1 GPUs but 0 are visible (none)"),
])
def test_too_few_visible_gpus_is_a_configuration_error(visible, size, tp, message):
    expected = f"--data-parallel-size {size} x tensor_parallel_size {tp} {message}"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        replica_gpus(visible, size, tp)


def test_pool_reads_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7,2,3")
    pool = LocalReplicaPool({}, 2, device="cuda", tensor_parallel_size=2)
    assert pool.gpu_sets() == ["6,7", "2,3"]


@pytest.mark.parametrize("visible", ["3", None])
def test_pool_asking_for_more_gpus_than_visible_fails_before_starting_any_replica(monkeypatch, visible):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # this CPU machine: CUDA counts none
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    before = set(children_of(os.getpid()))
    pool = LocalReplicaPool({"model": "unused"}, 2, device="cuda", tensor_parallel_size=1)
    start = time.monotonic()
    with pytest.raises(ConfigError, match="--data-parallel-size 2 x tensor_parallel_size 1 needs 2 GPUs but"):
        pool.start(timeout_s=600)
    assert time.monotonic() - start < 5
    assert pool.replicas == []
    assert set(children_of(os.getpid())) <= before  # no replica process was spawned
    pool.shutdown()


# -- Ray ---------------------------------------------------------------------------------
def test_ray_bundle_holds_a_whole_replica():
    assert replica_bundle(True, 1) == {"GPU": 1.0, "CPU": 1.0}
    assert replica_bundle(True, 4) == {"GPU": 4.0, "CPU": 1.0}
    assert replica_bundle(False, 3) == {"CPU": 3.0}


@pytest.mark.parametrize("use_gpu, tp", [(True, 1), (True, 2), (False, 1), (False, 3)])
def test_ray_actor_asks_for_exactly_its_bundle(use_gpu, tp):
    # Ray makes visible to an actor the GPUs it asks for: all tp of them, for the ranks it spawns itself
    asked = actor_resources(use_gpu, tp)
    assert asked["num_gpus"] == (tp if use_gpu else 0)
    assert asked["num_cpus"] == (1 if use_gpu else tp)
    assert RayReplicaPool({}, 2, use_gpu=use_gpu, tensor_parallel_size=tp, address=None).bundle == \
        replica_bundle(use_gpu, tp)


def test_ray_cluster_with_enough_resources_passes():
    check_resources({"GPU": 4.0, "CPU": 2.0}, 2, True, 2)
    check_resources({"CPU": 6.0}, 2, False, 3)


@pytest.mark.parametrize("cluster, size, use_gpu, tp, message", [
    ({"GPU": 1.0, "CPU": 64.0}, 2, True, 1, "needs 2 GPUs on the Ray cluster .* which has 1"),
    ({"CPU": 64.0}, 1, True, 1, "needs 1 GPUs on the Ray cluster .* which has 0"),
    ({"GPU": 3.0, "CPU": 64.0}, 2, True, 2, "needs 4 GPUs on the Ray cluster .* which has 3"),
    ({"GPU": 8.0, "CPU": 1.0}, 2, True, 1, "needs 2 CPUs on the Ray cluster .* which has 1"),
    ({"CPU": 5.0}, 2, False, 3, "needs 6 CPUs on the Ray cluster .* which has 5"),
])
def test_ray_cluster_too_small_is_a_configuration_error(cluster, size, use_gpu, tp, message):
    with pytest.raises(ConfigError, match=message):
        check_resources(cluster, size, use_gpu, tp)
