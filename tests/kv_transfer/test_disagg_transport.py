"""Disaggregated prefill's transport on the CPU: params, shared-memory segments, and a producer's
and a consumer's worker halves moving blocks between two caches over the control socket."""

from __future__ import annotations

import os
import time

import pytest
import torch

from pagoda.errors import InvalidRequestError
from pagoda.kv_transfer.disagg import shm
from pagoda.kv_transfer.disagg.consumer import ConsumerWorker
from pagoda.kv_transfer.disagg.params import RemoteDecode, RemotePrefill, parse_kv_transfer_params, private_ipc_address
from pagoda.kv_transfer.disagg.producer import ProducerWorker
from pagoda.kv_transfer.disagg.scheduler import BlockExport, BlockPull, ExportMetadata, PullMetadata

NUM_TENSORS, NUM_BLOCKS, PAGE_BYTES = 3, 10, 64
CPU = torch.device("cpu")


def remote(block_ids: tuple[int, ...] = (1, 2)) -> RemotePrefill:
    return RemotePrefill("ipc:///tmp/x", "req-0", "ab" * 16, block_ids, tuple(bytes([i]) * 32 for i in block_ids), 16)


def test_params_round_trip_and_name_the_bad_field() -> None:
    assert parse_kv_transfer_params(None) is None
    assert parse_kv_transfer_params({"do_remote_decode": True}) == RemoteDecode()
    assert parse_kv_transfer_params(remote().to_params()) == remote()
    cases = {
        "remote_block_hashes": {**remote().to_params(), "remote_block_hashes": ["00" * 32]},
        "num_tokens": {**remote().to_params(), "num_tokens": 31},
        "remote_address": {**remote().to_params(), "remote_address": "http://x"},
        "remote_token": {**remote().to_params(), "remote_token": "short"},
        "surprise": {**remote().to_params(), "surprise": 1},
    }
    for name, params in cases.items():
        with pytest.raises(InvalidRequestError) as caught:
            parse_kv_transfer_params(params)
        assert caught.value.param == f"kv_transfer_params.{name}", caught.value


def test_segments_unlink_and_stale_ones_are_removed() -> None:
    segment = shm.create_segment(128)
    segment.blocks((64,))[1].fill_(7)
    other = shm.open_segment(segment.name, 128)
    assert int(other.blocks((64,))[1, 5]) == 7
    with pytest.raises(ValueError, match="holds 128 bytes"):
        shm.open_segment(segment.name, 64)
    shm.unlink_segment(segment.name)
    assert int(other.blocks((64,))[1, 5]) == 7  # the mapping outlives the name
    for mapped in (segment, other):
        mapped.close()
    dead_pid = 2**22 + 12345  # above the kernel's default pid_max
    stale = os.path.join(shm.SHM_DIR, f"pagoda-kv-{dead_pid}-0")
    open(stale, "wb").close()
    assert shm.remove_stale_segments() >= 1 and not os.path.exists(stale)
    with pytest.raises(ValueError, match="not a KV transfer segment"):
        shm.open_segment("../etc/passwd", 1)


def caches(seed: int, device: torch.device = CPU) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, PAGE_BYTES // 2)
    made = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator) for _ in range(NUM_TENSORS)]
    return [cache.to(device) for cache in made]


def own_segments() -> list[str]:
    return [name for name in os.listdir(shm.SHM_DIR) if name.startswith(f"pagoda-kv-{os.getpid()}-")]


def wait_report(worker, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        report = worker.get_finished(wait_s=0.05)
        if report is not None:
            return report
    raise AssertionError("no transfer report")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def pair(request):
    """A producer and a consumer on the CPU, or on CUDA (staged through device memory and streams)."""
    device = torch.device(request.param)
    producer = ProducerWorker(private_ipc_address(), 0.5, NUM_TENSORS, PAGE_BYTES, device)
    consumer = ConsumerWorker(NUM_TENSORS, PAGE_BYTES, device, timeout_s=2.0)
    producer.copier.bind(caches(0, device))
    consumer.copier.bind(caches(1, device))
    try:
        yield producer, consumer
    finally:
        producer.shutdown()
        consumer.shutdown()


def pull(producer: ProducerWorker, token: str, remote_ids, local_ids) -> BlockPull:
    return BlockPull("pull-0", producer.address, "req-0", token, tuple(remote_ids), tuple(local_ids))


def test_a_pull_copies_the_blocks_and_its_ack_releases_them(pair) -> None:
    producer, consumer = pair
    token = "cd" * 16
    producer.bind_connector_metadata(ExportMetadata((BlockExport("req-0", token, (2, 3, 7)),)))
    consumer.bind_connector_metadata(PullMetadata((pull(producer, token, (3, 7), (5, 1)),)))
    consumer.start_load_kv()
    loaded = wait_report(consumer)
    assert loaded.finished_loads == {"pull-0"} and not loaded.failed_loads
    assert loaded.stats.load_bytes == 2 * NUM_TENSORS * PAGE_BYTES
    for theirs, mine in zip(producer.copier.caches, consumer.copier.caches, strict=True):
        assert torch.equal(mine[:, 5], theirs[:, 3]) and torch.equal(mine[:, 1], theirs[:, 7])
    released = wait_report(producer)
    assert released.finished_saves == {"req-0"} and released.stats.save_bytes == 2 * NUM_TENSORS * PAGE_BYTES
    producer.check_idle()
    consumer.check_idle()
    assert own_segments() == []


def test_a_refused_pull_fails_and_the_hold_expires(pair) -> None:
    producer, consumer = pair
    producer.bind_connector_metadata(ExportMetadata((BlockExport("req-0", "cd" * 16, (2, 3)),)))
    before = [cache.clone() for cache in consumer.copier.caches]
    consumer.bind_connector_metadata(PullMetadata((pull(producer, "ee" * 16, (2,), (4,)),)))  # wrong token
    consumer.start_load_kv()
    report = wait_report(consumer)
    assert report.failed_loads == {"pull-0"} and report.stats.num_failed_transfers == 1
    assert all(torch.equal(a, b) for a, b in zip(before, consumer.copier.caches, strict=True))
    expired = wait_report(producer)  # the 0.5 s hold timeout
    assert expired.failed_saves == {"req-0"} and expired.stats.num_failed_transfers == 1
    producer.check_idle()
    assert own_segments() == []


def test_a_pull_from_no_producer_fails_within_its_timeout() -> None:
    consumer = ConsumerWorker(NUM_TENSORS, PAGE_BYTES, CPU, timeout_s=0.3)
    consumer.copier.bind(caches(1))
    try:
        job = BlockPull("pull-0", private_ipc_address(), "req-0", "cd" * 16, (1,), (1,))
        consumer.bind_connector_metadata(PullMetadata((job,)))
        consumer.start_load_kv()
        assert wait_report(consumer).failed_loads == {"pull-0"}
    finally:
        consumer.shutdown()
