"""With cascade attention on, every decode size is captured twice (plain and cascaded); mixed
graphs stay single, and a batch is first matched to its plain graph."""

from __future__ import annotations

from pagoda.worker.cuda_graph import BatchDescriptor, CudaGraphManager


def test_cascade_doubles_the_decode_graphs_only() -> None:
    plain = CudaGraphManager([1, 2, 4, 8], max_decode_size=4, max_mixed_size=8)
    manager = CudaGraphManager([1, 2, 4, 8], max_decode_size=4, max_mixed_size=8, cascade=True)
    cascaded = set(manager.descriptors) - set(plain.descriptors)
    assert cascaded == {BatchDescriptor(size, True, cascade=True) for size in (1, 2, 4)}
    keys = manager.descriptors
    assert keys[0] == BatchDescriptor(8, False)
    assert [k.num_tokens for k in keys] == sorted((k.num_tokens for k in keys), reverse=True)
    assert manager.descriptor_for(3, uniform_decode=True) == BatchDescriptor(4, True)
