"""The scheduler with a KV connector (CPU offload), the worker played by hand: evicted cached
blocks are saved before the step that reuses them, a host hit admits the request to wait for
its load (no tokens scheduled, in no queue), the reported load brings it back with those
tokens computed and registered in the prefix cache; a preempted request resumes the same way.
No model runs here."""

from __future__ import annotations

import pytest
from kv_cache_utils import kv_cache_config

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.kv_transfer.interface import KVConnectorOutput
from pagoda.outputs import ModelRunnerOutput, RequestStatus
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.output import SchedulerOutput
from pagoda.scheduler.request import Request
from pagoda.scheduler.scheduler import Scheduler

BLOCK_SIZE = 4
BLOCK_BYTES = 1024  # two layers of 2 KV heads x 8, float32, 4 tokens
PROMPT = list(range(100, 117))  # 17 tokens: 4 blocks may hit


def make_scheduler(num_blocks: int, save_on_finish: bool = False, prompts_first: bool = False) -> Scheduler:
    cache = CacheConfig(
        block_size=BLOCK_SIZE,
        kv_offload_gib=64 * BLOCK_BYTES / 2**30,
        kv_offload_save_on_finish=save_on_finish,
        kv_offload_prompts_first=prompts_first,
    )
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    return Scheduler(config, cache, kv_cache_config(num_blocks, BLOCK_SIZE))


def request(req_id: str, tokens: list[int], max_tokens: int = 1) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_ids=set())


def worker_report(so: SchedulerOutput) -> KVConnectorOutput | None:
    """Every job of the step done, as the worker would report it."""
    meta = so.kv_connector_metadata
    if meta is None:
        return None
    return KVConnectorOutput(
        finished_saves=frozenset(job.job_id for job in meta.saves),
        finished_loads=frozenset(job.job_id for job in meta.loads),
    )


def step(scheduler: Scheduler, report: bool = True) -> SchedulerOutput:
    so = scheduler.schedule()
    req_ids = list(so.num_scheduled_tokens)
    sampled = [
        [7] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens else [] for r in req_ids
    ]
    output = ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)
    output.kv_connector_output = worker_report(so) if report else None
    scheduler.update_from_output(so, output)
    return so


def run_to_end(scheduler: Scheduler) -> None:
    for _ in range(32):
        if not (scheduler.has_unfinished_requests() or scheduler.has_finished_requests()):
            return
        step(scheduler)
    raise AssertionError("requests did not finish")


def evict(scheduler: Scheduler) -> None:
    """Run PROMPT, then other prompts that take the whole pool: PROMPT's blocks go to the host."""
    scheduler.add_request(request("first", PROMPT))
    run_to_end(scheduler)
    scheduler.add_request(
        request("other", list(range(200, 200 + 4 * scheduler.kv_cache_manager.block_pool.num_usable_blocks)))
    )
    so = scheduler.schedule()
    saves = so.kv_connector_metadata.saves
    assert [job.before_forward for job in saves] == [True] and len(saves[0].block_ids) == 4
    output = ModelRunnerOutput(["other"], {"other": 0}, [[7]])
    output.kv_connector_output = worker_report(so)
    scheduler.update_from_output(so, output)
    run_to_end(scheduler)


def test_a_host_hit_waits_for_its_load_then_runs_from_it() -> None:
    scheduler = make_scheduler(num_blocks=10)
    evict(scheduler)
    scheduler.add_request(request("again", PROMPT))
    so = step(scheduler, report=False)
    assert so.num_scheduled_tokens == {} and len(so.kv_connector_metadata.loads) == 1
    waiting = scheduler.requests["again"]
    assert waiting.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not scheduler.waiting
    load = so.kv_connector_metadata.loads[0]
    # It holds the block of its 17th token too: its first prefill chunk runs once it is loaded.
    (held,) = scheduler.kv_cache_manager.get_block_ids(waiting)
    assert len(load.slots) == 4 and list(load.block_ids) == held[:4] and len(held) == 5
    # Reported done (with the saves of the blocks its allocation evicted): back at the front of
    # the queue, its 16 tokens computed and cached.
    idle = scheduler.schedule()
    assert idle.kv_connector_metadata is not None  # empty, but the worker must report
    output = ModelRunnerOutput.empty()
    output.kv_connector_output = worker_report(so)
    scheduler.update_from_output(idle, output)
    assert waiting.status == RequestStatus.WAITING and waiting.num_computed_tokens == 16
    so = step(scheduler)
    (new,) = so.scheduled_new_reqs
    assert (new.num_computed_tokens, so.num_scheduled_tokens) == (16, {"again": 1})
    assert scheduler.make_stats().kv_transfer.hit_tokens == 16
    run_to_end(scheduler)
    scheduler.check_idle()


def test_save_on_finish_holds_the_blocks_and_the_request_id() -> None:
    scheduler = make_scheduler(num_blocks=10, save_on_finish=True)
    scheduler.add_request(request("a", PROMPT, max_tokens=1))
    so = step(scheduler, report=False)
    assert scheduler.has_finished_requests()  # its blocks wait on the save
    assert "a" in scheduler.remote_kv.held
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(request("a", PROMPT))
    so = scheduler.schedule()
    (save,) = so.kv_connector_metadata.saves
    assert not save.before_forward and len(save.block_ids) == 4
    with pytest.raises(AssertionError, match="not idle"):
        scheduler.check_idle()
    output = ModelRunnerOutput.empty()
    output.kv_connector_output = worker_report(so)
    scheduler.update_from_output(so, output)
    run_to_end(scheduler)
    scheduler.check_idle()
    assert scheduler.remote_kv.connector.index.num_cached == 4


def test_a_load_starts_while_the_step_budget_is_spent_on_another_prefill() -> None:
    scheduler = make_scheduler(num_blocks=10)
    evict(scheduler)
    scheduler.max_num_batched_tokens = 16
    scheduler.add_request(request("busy", list(range(300, 316))))  # 16 tokens: the whole budget
    scheduler.add_request(request("again", PROMPT))
    so = step(scheduler, report=False)
    assert so.num_scheduled_tokens == {"busy": 16}
    # Started anyway: its KV crosses PCIe during busy's step, into the 4 blocks it reads.
    (load,) = so.kv_connector_metadata.loads
    assert len(load.block_ids) == 4
    assert scheduler.requests["again"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(scheduler.kv_cache_manager.get_block_ids(scheduler.requests["again"])[0]) == 5
    output = ModelRunnerOutput.empty()
    output.kv_connector_output = worker_report(so)
    idle = scheduler.schedule()
    scheduler.update_from_output(idle, output)
    so = step(scheduler)
    assert so.num_scheduled_tokens["again"] == 1  # straight from its load, in the blocks it holds
    run_to_end(scheduler)
    scheduler.check_idle()


@pytest.mark.parametrize("prompts_first", [False, True], ids=["fcfs", "prompts-first"])
def test_prompts_first_swaps_a_decoding_request_out_once(prompts_first: bool) -> None:
    scheduler = make_scheduler(num_blocks=10, prompts_first=prompts_first)  # 9 blocks: one 17-token prompt
    scheduler.add_request(request("a", PROMPT, max_tokens=6))
    step(scheduler)
    step(scheduler)  # a decodes
    scheduler.add_request(request("b", list(range(300, 317)), max_tokens=4))
    so = step(scheduler)
    if not prompts_first:
        assert so.num_scheduled_tokens == {"a": 1} and not so.preempted_req_ids  # b waits for a to end
        run_to_end(scheduler)
        return
    # a goes out (to the back of the queue, its blocks cached, saved as they are evicted), b in.
    assert so.preempted_req_ids == {"a"} and so.num_scheduled_tokens == {"b": 17}
    assert [r.request_id for r in scheduler.waiting] == ["a"]
    scheduler.add_request(request("c", list(range(400, 417))))
    so = step(scheduler)
    # c queues behind a: a swapped request keeps its place before later prompts.
    assert so.num_scheduled_tokens == {"b": 1} and not so.preempted_req_ids
    run_to_end(scheduler)
    assert scheduler.requests == {} and scheduler.num_preemptions == 1
    scheduler.check_idle()
