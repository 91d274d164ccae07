"""The Ray executor on a local Ray cluster (CPU actors, gloo between them).

TP=2 and PP=2 over Ray actors must give greedy output token-identical to a single rank in
float32; an actor killed mid-generation or between calls fails the engine within seconds,
naming its rank, and a rank that raises fails the call;
too few CPUs for the ranks fail with the count asked for; the rank layout across nodes
(pure logic, no cluster needed) keeps a node's ranks consecutive.
"""

from __future__ import annotations

import importlib
import sys
import time

import pytest

ray = pytest.importorskip("ray")

from model_utils import save_tiny_checkpoint  # noqa: E402
from parallel_utils import ENGINE, FAILURE_DEADLINE_S, GenerationUntilFailure, greedy, make_prompts  # noqa: E402
from ray.util import placement_group_table  # noqa: E402

from pagoda import LLM  # noqa: E402
from pagoda.config import ConfigError  # noqa: E402
from pagoda.engine.errors import EngineDeadError, WorkerFailedError  # noqa: E402
from pagoda.executor import ray as ray_executor  # noqa: E402

RAY = {**ENGINE, "distributed_executor_backend": "ray"}
CLUSTER_CPUS = 4


def live_placement_groups() -> list[str]:
    return [pg_id for pg_id, pg in placement_group_table().items() if pg["state"] != "REMOVED"]


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    """A local cluster this module owns: the executor joins it and must leave it running."""
    ray.init(num_cpus=CLUSTER_CPUS, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[str, list[list[int]]]:
    """A tiny checkpoint and its single-rank greedy output (the reference)."""
    path = str(tmp_path_factory.mktemp("llama3"))
    save_tiny_checkpoint("llama3", path)
    return path, greedy(LLM(path, **ENGINE), make_prompts())


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_split_over_ray_actors_matches_single_rank(start_llm, checkpoint, tp: int, pp: int) -> None:
    path, reference = checkpoint
    llm = start_llm(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **RAY)
    executor = llm.llm_engine.engine_core.executor
    assert isinstance(executor, ray_executor.RayExecutor)
    assert len(executor.actors) == 2 and len(live_placement_groups()) == 1
    assert greedy(llm, make_prompts()) == reference
    llm.llm_engine.check_idle()
    # A rank that raises (sleep mode is off) fails the call, naming the rank and the cause.
    with pytest.raises(WorkerFailedError, match=r"worker rank \d failed in sleep: RuntimeError: sleep mode is off"):
        executor.collective_rpc("sleep", 1)
    llm.shutdown()
    assert not live_placement_groups(), "shutdown left the placement group reserved"
    assert ray.is_initialized(), "shutdown stopped a Ray cluster the executor did not start"


def test_killed_actor_fails_the_engine_quickly(start_llm, checkpoint) -> None:
    path, _ = checkpoint
    llm = start_llm(path, tensor_parallel_size=2, **RAY)
    executor = llm.llm_engine.engine_core.executor
    assert executor.output_rank == 0
    generation = GenerationUntilFailure(lambda: greedy(llm, make_prompts(4) * 50, max_tokens=100))
    generation.wait_in_flight(llm)
    ray.kill(executor.actors[1])
    error = generation.wait(FAILURE_DEADLINE_S)
    assert isinstance(error, EngineDeadError), error
    assert isinstance(error.__cause__, WorkerFailedError)
    assert "worker rank 1 died in execute_model" in str(error.__cause__)
    llm.shutdown()
    assert not live_placement_groups()


def test_actor_killed_between_calls_fails_the_next_one(start_llm, checkpoint) -> None:
    """PP=2: the first stage's actor (not the driver) is dead before generate starts; the
    driver would wait for its hidden states forever, the engine must not."""
    path, _ = checkpoint
    llm = start_llm(path, pipeline_parallel_size=2, **RAY)
    executor = llm.llm_engine.engine_core.executor
    assert executor.output_rank == 1
    ray.kill(executor.actors[0])
    started = time.monotonic()
    with pytest.raises(EngineDeadError) as failure:
        greedy(llm, make_prompts())
    assert time.monotonic() - started < FAILURE_DEADLINE_S
    assert "worker rank 0 died in execute_model" in str(failure.value.__cause__)
    llm.shutdown()
    assert not live_placement_groups()


def test_too_few_cpus_name_the_count(checkpoint, monkeypatch) -> None:
    path, _ = checkpoint
    monkeypatch.setattr(ray_executor, "PLACEMENT_GROUP_TIMEOUT_S", 1.0)
    with pytest.raises(RuntimeError, match=r"could not reserve 8 CPUs .* within 1 s; the cluster has 4 CPUs"):
        LLM(path, tensor_parallel_size=4, pipeline_parallel_size=2, **RAY)
    assert not live_placement_groups()


def test_ranks_of_a_node_are_consecutive() -> None:
    # Four GPU actors on two nodes, created in no particular order.
    places = [("10.0.0.2", [1]), ("10.0.0.1", [3]), ("10.0.0.2", [0]), ("10.0.0.1", [2])]
    ranks = ray_executor.place_ranks(places)
    assert [rank.actor for rank in ranks] == [3, 1, 2, 0]
    assert [rank.node_ip for rank in ranks] == ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"]
    assert [rank.local_rank for rank in ranks] == [0, 1, 0, 1]
    assert [rank.node_gpu_ids for rank in ranks] == [[2, 3], [2, 3], [0, 1], [0, 1]]
    # Each rank's device, cuda:{local_rank} among its node's GPUs, is the GPU Ray gave its actor.
    for rank in ranks:
        assert [rank.node_gpu_ids[rank.local_rank]] == places[rank.actor][1]


def test_missing_ray_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    monkeypatch.delitem(sys.modules, "pagoda.executor.ray")
    with pytest.raises(ConfigError, match="pip install ray"):
        importlib.import_module("pagoda.executor.ray")
