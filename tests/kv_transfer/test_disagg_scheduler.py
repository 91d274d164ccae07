"""The held-block bookkeeping of disaggregated prefill's scheduler halves, on plain requests."""

from __future__ import annotations

from pagoda.kv_transfer.disagg.params import RemotePrefill, parse_kv_transfer_params
from pagoda.kv_transfer.disagg.scheduler import ConsumerScheduler, ExportMetadata, ProducerScheduler, PullMetadata
from pagoda.kv_transfer.interface import KVConnectorOutput
from pagoda.outputs import RequestStatus
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.output import CachedRequestData, SchedulerOutput
from pagoda.scheduler.request import Request

BLOCK = 4
HASHES = [bytes([i]) * 32 for i in range(1, 5)]


def request(req_id: str, params: dict | None, num_tokens: int = 17, hashes=HASHES) -> Request:
    made = Request(req_id, list(range(num_tokens)), SamplingParams(kv_transfer_params=params), set())
    made.block_hashes = list(hashes)
    return made


def step_output() -> SchedulerOutput:
    """A step that schedules nothing (the connectors build their metadata from their own state)."""
    return SchedulerOutput([], CachedRequestData(), {}, 0)


def test_producer_holds_asked_requests_until_their_export_ends() -> None:
    producer = ProducerScheduler("ipc:///tmp/p", BLOCK)
    asked = request("a", {"do_remote_decode": True})
    asked.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert producer.request_finished(asked, [7, 8, 9, 10])
    params = parse_kv_transfer_params(producer.finished_kv_transfer_params(asked))
    assert isinstance(params, RemotePrefill)
    assert params.remote_block_ids == (7, 8, 9, 10) and params.remote_block_hashes == tuple(HASHES)
    assert params.num_tokens == 16 and params.remote_address == "ipc:///tmp/p"
    for status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
        aborted = request("b", {"do_remote_decode": True})
        aborted.status = status
        assert not producer.request_finished(aborted, [1, 2])
    plain = request("c", None)
    plain.status = RequestStatus.FINISHED_STOPPED
    assert not producer.request_finished(plain, [1, 2])
    assert not producer.request_finished(asked, [])  # a prompt under one block holds nothing
    metadata = producer.build_connector_meta(step_output())
    assert isinstance(metadata, ExportMetadata) and [e.block_ids for e in metadata.exports] == [(7, 8, 9, 10)]
    assert metadata.exports[0].token == params.remote_token
    assert producer.has_pending_transfers()
    assert producer.build_connector_meta(step_output()) == ExportMetadata(())  # keeps the worker reporting
    update = producer.update_connector_output(KVConnectorOutput(finished_saves=frozenset({"a"})))
    assert update.released == {"a"} and not producer.has_pending_transfers()
    assert producer.build_connector_meta(step_output()) is None
    producer.check_idle()


def consumer_request(req_id: str, hashes=HASHES, num_tokens: int = 17, block_size: int = BLOCK) -> Request:
    params = RemotePrefill("ipc:///tmp/p", "remote-" + req_id, "ab" * 16, (11, 12, 13, 14), tuple(HASHES), block_size)
    return request(req_id, params.to_params(), num_tokens, hashes)


def test_consumer_offers_the_hash_matched_blocks_once() -> None:
    consumer = ConsumerScheduler(BLOCK)
    full = consumer_request("a")
    assert consumer.get_num_new_matched_tokens(full, 0) == 16
    assert consumer.get_num_new_matched_tokens(full, 8) == 8  # past the device hits
    # The last prompt token is always computed: a 16-token prompt loads 3 blocks.
    assert consumer.get_num_new_matched_tokens(consumer_request("b", num_tokens=16), 0) == 12
    # A different prompt from block 2 on matches 2 blocks only.
    assert consumer.get_num_new_matched_tokens(consumer_request("c", HASHES[:2] + [b"x" * 32] * 2), 0) == 8
    assert consumer.get_num_new_matched_tokens(consumer_request("d", block_size=8), 0) == 0
    assert consumer.get_num_new_matched_tokens(request("e", {"do_remote_decode": True}), 0) == 0

    full.num_computed_tokens = 4
    consumer.update_state_after_alloc(full, [0, 21, 22, 23, 24], 12)
    metadata = consumer.build_connector_meta(step_output())
    assert isinstance(metadata, PullMetadata)
    (pull,) = metadata.pulls
    assert pull.remote_block_ids == (12, 13, 14) and pull.block_ids == (21, 22, 23)
    assert pull.remote_request_id == "remote-a"
    assert consumer.get_num_new_matched_tokens(full, 0) == 0  # offered once
    update = consumer.update_connector_output(KVConnectorOutput(finished_loads=frozenset({pull.job_id})))
    assert update.loaded == {"a"} and consumer.stats.hit_tokens == 12
    assert consumer.request_finished(full, [21, 22, 23]) is False
    consumer.check_idle()


def test_consumer_reports_a_failed_pull_for_recompute() -> None:
    consumer = ConsumerScheduler(BLOCK)
    failing = consumer_request("a")
    consumer.update_state_after_alloc(failing, [1, 2, 3, 4, 5], 16)
    (pull,) = consumer.build_connector_meta(step_output()).pulls
    update = consumer.update_connector_output(KVConnectorOutput(failed_loads=frozenset({pull.job_id})))
    assert update.failed == {"a"} and consumer.stats.hit_tokens == 0
    consumer.request_finished(failing, [])
    consumer.check_idle()
