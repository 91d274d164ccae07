"""The Ray executor: one Worker per rank, each in a Ray actor, on one machine or many.

Placement: a placement group of one bundle per rank (`{"GPU": 1}` on CUDA, `{"CPU": 1}` on
the CPU), strategy PACK, so the ranks fill as few nodes as they can. The actors are then
ordered by (node IP, GPU ids), which makes the ranks of a node consecutive: with the ranks
laid out pipeline-major (`parallel_state`), a tensor-parallel group stays within a node when
each node holds a multiple of `tensor_parallel_size` ranks, and pipeline stages cross nodes.

Devices: Ray narrows each GPU actor's CUDA_VISIBLE_DEVICES to its own GPU. Each actor
instead gets the GPUs of every rank on its node, in rank order, and its `local_rank` (its
index among them) names its own one, as `cuda:{local_rank}` does in the multiprocess
executor: the Worker is unchanged, `local_rank` keeps its meaning (the device index on the
node), and every rank sees its node's peers, as peer-to-peer copies between them expect.

Messages: each step's `SchedulerOutput` is put in the object store once and every actor
receives the same reference; an actor runs its calls in the order they were sent. The
driver rank (TP rank 0 of the last pipeline stage) resolves its output to the host before
returning it (the actor has no thread to hand it to), so on that rank the next step's host
preparation does not overlap this step's device work; the engine still schedules ahead.

Failures: every wait on the actors watches every rank, so a rank that dies or raises fails
the call with `WorkerFailedError` naming it, instead of the engine hanging on a collective
the dead rank will never join; `shutdown` then kills the actors. Ray itself is left running
unless this executor started it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagoda.config import ConfigError, EngineConfig
from pagoda.distributed.parallel_state import free_port
from pagoda.engine.errors import WorkerFailedError
from pagoda.executor.abstract import Executor
from pagoda.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
from pagoda.scheduler.output import SchedulerOutput

try:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
    from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as error:
    raise ConfigError(
        "distributed_executor_backend 'ray' needs Ray, which is not installed: pip install ray "
        "(or pip install 'pagoda-llm[ray]')"
    ) from error

if TYPE_CHECKING:
    from pagoda.worker.worker import Worker

logger = logging.getLogger(__name__)

# How long to wait for the cluster to grant one bundle per rank (an autoscaler may add nodes).
PLACEMENT_GROUP_TIMEOUT_S = 300.0
# After a rank raises, how long to look for a peer whose actor died: that death is the cause
# (a collective with a dead peer fails on the living ranks too), so the error names it.
DEAD_PEER_GRACE_S = 2.0


@dataclass
class RankPlacement:
    """Where one rank runs: `actor` indexes the actors as created (one per bundle)."""

    actor: int
    node_ip: str
    local_rank: int  # index among the ranks of its node
    node_gpu_ids: list[Any]  # the GPUs of every rank on its node, in rank order (empty on the CPU)


def place_ranks(places: list[tuple[str, list[Any]]]) -> list[RankPlacement]:
    """Ranks in order, from each actor's (node IP, Ray GPU ids): sorted by node, then GPU, so
    that a node's ranks are consecutive and the GPU of rank r on a node is `node_gpu_ids[local_rank]`."""
    order = sorted(range(len(places)), key=lambda i: (places[i][0], places[i][1], i))
    ranks: list[RankPlacement] = []
    for i in order:
        node_ip = places[i][0]
        same_node = [j for j in order if places[j][0] == node_ip]
        gpu_ids = [gpu for j in same_node for gpu in places[j][1]]
        ranks.append(RankPlacement(i, node_ip, same_node.index(i), gpu_ids))
    return ranks


class RayWorkerWrapper:
    """One rank: a Worker inside a Ray actor, built once the executor knows its rank."""

    def __init__(self) -> None:
        self.worker: Worker | None = None  # imported in the actor only: the engine's process needs none

    def node_and_gpu_ids(self) -> tuple[str, list[Any]]:
        return ray.util.get_node_ip_address(), list(ray.get_gpu_ids())

    def free_port(self) -> int:
        return free_port()

    def init_worker(
        self,
        config: EngineConfig,
        rank: int,
        local_rank: int,
        distributed_init_method: str,
        is_driver_worker: bool,
        return_hidden_states: bool,
        node_gpu_ids: list[Any],
    ) -> None:
        """Build, place and load this rank's Worker; every rank must be called at once (they meet
        in torch.distributed's rendezvous)."""
        if node_gpu_ids:  # before anything in this process touches CUDA
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpu) for gpu in node_gpu_ids)
        from pagoda.worker.worker import Worker

        self.worker = Worker(
            config,
            local_rank=local_rank,
            rank=rank,
            distributed_init_method=distributed_init_method,
            is_driver_worker=is_driver_worker,
            return_hidden_states=return_hidden_states,
        )
        self.worker.init_device()
        self.worker.load_model()

    def call(self, method: str, args: tuple[Any, ...]) -> Any:
        assert self.worker is not None
        return getattr(self.worker, method)(*args)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        from pagoda.worker.async_output import AsyncGPUModelRunnerOutput

        assert self.worker is not None
        output = self.worker.execute_model(scheduler_output)
        if isinstance(output, AsyncGPUModelRunnerOutput):
            return output.host_output()  # the Worker itself resolves it after the next step's launch
        return output


class RayFutureOutput(AsyncModelRunnerOutput):
    """One step in flight on every rank; resolves to the driver rank's output."""

    def __init__(self, executor: RayExecutor, refs: list[ray.ObjectRef]) -> None:
        self.executor = executor
        self.refs = refs

    def get_output(self) -> ModelRunnerOutput:
        return self.executor.wait(self.refs, "execute_model")[self.executor.output_rank]


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        parallel = config.parallel_config
        self.world_size = parallel.world_size
        self.output_rank = parallel.driver_rank
        self.actors: list[ray.actor.ActorHandle] = []
        self.placement_group: PlacementGroup | None = None
        self.started_ray = connect_ray()
        try:
            self._start_workers()
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self) -> None:
        parallel = self.config.parallel_config
        on_gpu = self.config.device_config.is_cuda
        resource = "GPU" if on_gpu else "CPU"
        self.placement_group = placement_group([{resource: 1}] * self.world_size, strategy="PACK")
        try:
            ray.get(self.placement_group.ready(), timeout=PLACEMENT_GROUP_TIMEOUT_S)
        except GetTimeoutError as error:
            raise RuntimeError(
                f"Ray could not reserve {self.world_size} {resource}s (one per rank: tensor_parallel_size "
                f"{parallel.tensor_parallel_size} x pipeline_parallel_size {parallel.pipeline_parallel_size}) within "
                f"{PLACEMENT_GROUP_TIMEOUT_S:g} s; the cluster has {ray.cluster_resources().get(resource, 0):g} "
                f"{resource}s, {ray.available_resources().get(resource, 0):g} free"
            ) from error
        actor_class = ray.remote(RayWorkerWrapper)
        actors = [
            actor_class.options(
                num_cpus=0 if on_gpu else 1,
                num_gpus=1 if on_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_group, placement_group_bundle_index=bundle
                ),
            ).remote()
            for bundle in range(self.world_size)
        ]
        self.actors = actors  # so that shutdown kills them should placing fail
        places = self.wait([actor.node_and_gpu_ids.remote() for actor in actors], "node_and_gpu_ids")
        ranks = place_ranks(places)
        self.actors = [actors[rank.actor] for rank in ranks]
        node_ips = [rank.node_ip for rank in ranks]
        self._warn_split_tp_groups(node_ips)
        init_method = parallel.distributed_init_method
        if init_method is None:
            (port,) = self.wait([self.actors[0].free_port.remote()], "free_port")
            host = f"[{node_ips[0]}]" if ":" in node_ips[0] else node_ips[0]
            init_method = f"tcp://{host}:{port}"
        config_ref = ray.put(self.config)
        self.wait(
            [
                actor.init_worker.remote(
                    config_ref,
                    rank,
                    place.local_rank,
                    init_method,
                    rank == self.output_rank,
                    rank < self.output_rank,
                    place.node_gpu_ids,
                )
                for rank, (actor, place) in enumerate(zip(self.actors, ranks, strict=True))
            ],
            "init_worker",
        )
        logger.info(
            "started %d Ray actors on %d nodes (%s; driver rank %d, %s)",
            self.world_size,
            len(set(node_ips)),
            ", ".join(f"{ip}: {n} ranks" for ip, n in Counter(node_ips).items()),
            self.output_rank,
            init_method,
        )

    def _warn_split_tp_groups(self, node_ips: list[str]) -> None:
        tp_size = self.config.parallel_config.tensor_parallel_size
        split = [ip for ip, n in Counter(node_ips).items() if n % tp_size]
        if split:
            logger.warning(
                "nodes %s hold a number of ranks that is not a multiple of tensor_parallel_size %d: some "
                "tensor-parallel groups span nodes, and their all-reduces cross the network",
                ", ".join(split),
                tp_size,
            )

    def wait(self, refs: list[ray.ObjectRef], method: str) -> list[Any]:
        """The results of one call per rank, in rank order. Fails as soon as any rank fails (the
        others may be stuck in a collective with it): WorkerFailedError naming the rank."""
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            (ref,), pending = ray.wait(pending, num_returns=1)
            try:
                results[refs.index(ref)] = ray.get(ref)
            except RayError as error:
                raise self._failure(refs, refs.index(ref), error, method) from error
        return results

    def _failure(self, refs: list[ray.ObjectRef], rank: int, error: RayError, method: str) -> WorkerFailedError:
        """The error to raise for `rank`'s failure, blaming a peer whose actor died instead when
        one did: the living ranks fail (or hang) in collectives with it."""
        message = f"worker rank {rank} failed in {method}: {describe(error)}"
        if isinstance(error, RayActorError):
            message = f"worker rank {rank} died in {method}: {error}"
        else:
            others = [ref for i, ref in enumerate(refs) if i != rank]
            ready, _ = ray.wait(others, num_returns=len(others), timeout=DEAD_PEER_GRACE_S) if others else ([], [])
            for ref in ready:
                try:
                    ray.get(ref)
                except RayActorError as death:
                    message = f"worker rank {refs.index(ref)} died in {method}: {death} (then {message})"
                    break
                except RayError:
                    continue
        logger.error("%s\n%s", message, error)  # the error itself carries the rank's traceback
        return WorkerFailedError(message)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        args_ref = ray.put(args)  # serialized once for every rank
        return self.wait([actor.call.remote(method, args_ref) for actor in self.actors], method)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        output_ref = ray.put(scheduler_output)  # serialized once for every rank
        return RayFutureOutput(self, [actor.execute_model.remote(output_ref) for actor in self.actors])

    def shutdown(self) -> None:
        """Kill the actors and free their bundles; stop Ray only if this executor started it."""
        if ray.is_initialized():
            for actor in self.actors:
                with contextlib.suppress(RayError):  # already dead
                    ray.kill(actor)
            if self.placement_group is not None:
                remove_placement_group(self.placement_group)
        self.actors, self.placement_group = [], None
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False


def connect_ray() -> bool:
    """Join the running Ray cluster (RAY_ADDRESS, or the one `ray start` left on this node),
    else start a local one; True if this started it."""
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init()  # reads RAY_ADDRESS; a cluster named but unreachable is an error, not a local start
        return False
    try:
        ray.init(address="auto")
        return False
    except ConnectionError:
        ray.init(include_dashboard=False)
        return True


def describe(error: RayError) -> str:
    """What a rank raised (Ray's own text leads with a colored header and the whole traceback)."""
    cause = error.cause if isinstance(error, RayTaskError) else None
    return f"{type(cause).__name__}: {cause}" if cause is not None else str(error)
