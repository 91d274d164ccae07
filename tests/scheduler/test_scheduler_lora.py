"""The scheduler and the KV-cache manager with LoRA requests: at most `max_loras` distinct
adapters run at once (a request with another waits, keeping its place, while later requests
of running adapters or of none go ahead), and an adapter keys its requests' block hashes."""

from __future__ import annotations

from kv_cache_utils import kv_cache_config

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.lora.request import LoRARequest
from pagoda.outputs import ModelRunnerOutput
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.kv_cache_manager import block_extra_keys
from pagoda.scheduler.request import Request
from pagoda.scheduler.scheduler import Scheduler

FIRST, SECOND = LoRARequest("first", 1, "/adapters/first"), LoRARequest("second", 2, "/adapters/second")


def _request(req_id: str, lora: LoRARequest | None, cache_salt: str | None = None) -> Request:
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = [ord(c) for c in req_id.ljust(8, ".")]  # its own prompt: no request waits on another's blocks
    return Request(req_id, prompt, params, eos_token_ids=set(), cache_salt=cache_salt, lora_request=lora)


def _step(scheduler: Scheduler) -> set[str]:
    """One step: schedule, then a token for every scheduled request; the ids scheduled."""
    output = scheduler.schedule()
    req_ids = list(output.num_scheduled_tokens)
    scheduler.update_from_output(
        output, ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, [[5] for _ in req_ids])
    )
    return set(req_ids)


def test_at_most_max_loras_adapters_run_at_once() -> None:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=32)
    scheduler = Scheduler(config, CacheConfig(block_size=4), kv_cache_config(64, 4), max_loras=1)
    for req_id, lora in (("a", FIRST), ("b", SECOND), ("c", None), ("d", FIRST)):
        scheduler.add_request(_request(req_id, lora))
    assert _step(scheduler) == {"a", "c", "d"}
    assert [r.request_id for r in scheduler.waiting] == ["b"]
    while scheduler.running:
        assert "b" not in _step(scheduler)
    assert _step(scheduler) == {"b"}  # the first adapter's requests ended: the second one's turn
    while scheduler.has_unfinished_requests() or scheduler.has_finished_requests():
        _step(scheduler)
    scheduler.check_idle()


def test_adapters_key_block_hashes() -> None:
    keys = [
        block_extra_keys(_request("base", None)),
        block_extra_keys(_request("first", FIRST)),
        block_extra_keys(_request("second", SECOND)),
        block_extra_keys(_request("salted", FIRST, cache_salt="tenant")),
        block_extra_keys(_request("salt only", None, cache_salt="tenant")),
    ]
    assert keys[0] == b"" and len(set(keys)) == len(keys)
    # A salt cannot pose as an adapter: every part is tagged and length-prefixed.
    forged = block_extra_keys(_request("forged", None, cache_salt=keys[1].decode("latin-1")))
    assert forged not in keys
