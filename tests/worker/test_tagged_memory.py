"""Tagged memory pools: the CPU fallback, the VMM bookkeeping over a fake driver, and (marked
`gpu`) real CUDA virtual memory: free memory, contents, pointers and graphs across sleep."""

from __future__ import annotations

import ctypes

import pytest
import torch
from torch import nn

from pagoda.worker import tagged_memory
from pagoda.worker.tagged_memory import (
    CudaDriverError,
    TaggedMemoryError,
    TaggedMemoryPool,
    VmmUnsupportedError,
)

MiB = 2**20


class TiedModel(nn.Module):
    """Embedding tied to the LM head, a buffer, and two parameters that are views of one storage."""

    def __init__(self, vocab: int = 64, hidden: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.SiLU(), nn.Linear(4 * hidden, hidden))
        fused = torch.randn(2 * hidden)
        self.scale = nn.Parameter(fused[:hidden])
        self.shift = nn.Parameter(fused[hidden:])
        self.register_buffer("offset", torch.randn(hidden))
        self.register_buffer("derived", torch.randn(hidden), persistent=False)  # like rotary cos/sin
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        hidden = hidden + self.mlp(hidden) * self.scale + self.shift + self.offset * self.derived
        return self.head(hidden)


def make_model(device: str) -> nn.Module:
    return TiedModel().to(device).requires_grad_(False).eval()


def state_storages(module: nn.Module) -> set[int]:
    return {tensor.untyped_storage().data_ptr() for tensor in module.state_dict().values()}


# ---- CPU fallback -------------------------------------------------------------------------


def test_cpu_allocate_release_with_offload_restores_same_tensor() -> None:
    pool = TaggedMemoryPool("cpu")
    x = pool.allocate("kv_cache", (3, 5), torch.float32)
    assert x.shape == (3, 5) and x.dtype == torch.float32 and torch.equal(x, torch.zeros(3, 5))
    assert pool.tags == ("kv_cache",) and pool.nbytes("kv_cache") >= 60
    values = torch.randn(3, 5)
    x.copy_(values)

    pool.release("kv_cache", offload=True)
    assert pool.is_released("kv_cache")
    assert x.untyped_storage().nbytes() == 0  # the memory is really dropped
    pool.restore("kv_cache")
    assert not pool.is_released("kv_cache")
    assert torch.equal(x, values)  # the caller's tensor object holds the data again


def test_cpu_release_without_offload_restores_zeros() -> None:
    pool = TaggedMemoryPool("cpu")
    x = pool.allocate("kv_cache", (16,), torch.bfloat16)
    x.fill_(2.5)
    pool.release("kv_cache", offload=False)
    pool.restore("kv_cache")
    assert torch.equal(x, torch.zeros(16, dtype=torch.bfloat16))


def test_cpu_tags_are_released_independently() -> None:
    pool = TaggedMemoryPool("cpu")
    weights = pool.allocate("weights", (8,), torch.float32).fill_(1.0)
    kv = pool.allocate("kv_cache", (8,), torch.float32).fill_(2.0)
    pool.release("kv_cache", offload=False)
    assert not pool.is_released("weights") and pool.is_released("kv_cache")
    assert torch.equal(weights, torch.ones(8))
    pool.restore("kv_cache")
    assert torch.equal(kv, torch.zeros(8)) and torch.equal(weights, torch.ones(8))


def test_cpu_misuse_raises_clear_errors() -> None:
    pool = TaggedMemoryPool("cpu")
    with pytest.raises(TaggedMemoryError, match="unknown tag 'weights'"):
        pool.release("weights", offload=True)
    with pytest.raises(ValueError, match=r"shape \(4, 0\)"):
        pool.allocate("weights", (4, 0), torch.float32)
    pool.allocate("weights", (4,), torch.float32)
    with pytest.raises(TaggedMemoryError, match="is not released"):
        pool.restore("weights")
    pool.release("weights", offload=False)
    with pytest.raises(TaggedMemoryError, match="already released"):
        pool.release("weights", offload=False)
    with pytest.raises(TaggedMemoryError, match="restore it before allocating"):
        pool.allocate("weights", (4,), torch.float32)
    with pytest.raises(ValueError, match="'cuda' and 'cpu'"):
        TaggedMemoryPool("meta")


def test_cpu_pack_module_keeps_outputs_ties_and_views() -> None:
    model = make_model("cpu")
    ids = torch.randint(0, 64, (2, 7))
    expected = model(ids)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.parameters()}
    unique_bytes = sum(storages.values())
    pool = TaggedMemoryPool("cpu")

    packed = pool.pack_module(model, "weights")

    assert pool.nbytes("weights") == packed >= unique_bytes
    assert len(state_storages(model)) == 1  # one region holds every parameter and persistent buffer
    assert model.derived.untyped_storage().data_ptr() not in state_storages(model)
    assert model.head.weight is model.embed.weight
    assert model.scale.data_ptr() + model.scale.numel() * 4 == model.shift.data_ptr()  # still one fused storage
    assert torch.equal(model(ids), expected)
    with torch.inference_mode():  # how the engine runs it
        assert torch.equal(model(ids), expected)


def test_cpu_pack_module_survives_sleep_and_in_place_weight_update() -> None:
    model = make_model("cpu")
    ids = torch.randint(0, 64, (2, 7))
    expected = model(ids)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    pool = TaggedMemoryPool("cpu")
    pool.pack_module(model, "weights")

    pool.release("weights", offload=True)  # sleep level 1
    pool.restore("weights")
    assert torch.equal(model(ids), expected)

    pool.release("weights", offload=False)  # sleep level 2: weights come back as zeros...
    pool.restore("weights")
    assert all(torch.count_nonzero(tensor) == 0 for tensor in model.state_dict().values())
    assert torch.count_nonzero(model.derived) > 0  # non-persistent buffers are not the pool's
    with torch.no_grad():  # ...and are loaded again in place
        for name, tensor in model.state_dict().items():
            tensor.copy_(state[name])
    assert torch.equal(model(ids), expected)


def test_cpu_pack_module_rejects_tensors_it_cannot_move() -> None:
    pool = TaggedMemoryPool("cpu")
    with pytest.raises(ValueError, match="weight is on meta"):
        pool.pack_module(nn.Linear(2, 2, device="meta"), "weights")
    with torch.inference_mode():
        inference_model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="weight is an inference tensor"):
        pool.pack_module(inference_model, "weights")


# ---- CUDA driver bindings, checked without a GPU ----------------------------------------


def test_driver_struct_layouts_match_cuda_h() -> None:
    prop = tagged_memory._CUmemAllocationProp
    assert ctypes.sizeof(prop) == 32
    assert (prop.location.offset, prop.win32HandleMetaData.offset, prop.allocFlags.offset) == (8, 16, 24)
    assert ctypes.sizeof(tagged_memory._CUmemAccessDesc) == 12
    assert tagged_memory._CUmemAccessDesc.flags.offset == 8


def test_missing_libcuda_raises_vmm_unsupported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tagged_memory, "_LIBCUDA_NAMES", ("libcuda-does-not-exist.so.1",))
    tagged_memory._cuda_driver.cache_clear()
    try:
        with pytest.raises(VmmUnsupportedError, match="NVIDIA driver library"):
            TaggedMemoryPool("cuda:0")
    finally:
        tagged_memory._cuda_driver.cache_clear()


class FakeLibcuda:
    """Stands in for libcuda: records VMM calls over a device of `capacity` bytes.

    Output arguments arrive as ctypes byref objects; `._obj` is the variable they point to.
    """

    base_address = 0x7F00_0000_0000
    granularity = 2 * MiB

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.handles: dict[int, int] = {}  # live handle -> size
        self.mappings: dict[int, tuple[int, int]] = {}  # address -> (size, handle)
        self.accessible: set[int] = set()
        self.log: list[str] = []
        self._next_handle = 1

        def ok(*_: object) -> int:
            return 0

        def set_out(value: int):
            def call(out: ctypes._CArgObject, *_: object) -> int:
                out._obj.value = value
                return 0

            return call

        self.cuInit = ok
        self.cuDeviceGet = set_out(0)
        self.cuCtxGetCurrent = set_out(0x1234)
        self.cuCtxSetCurrent = ok
        self.cuDevicePrimaryCtxRetain = set_out(0x1234)
        self.cuDeviceGetAttribute = set_out(1)
        self.cuMemGetAllocationGranularity = set_out(self.granularity)
        self.cuMemAddressReserve = set_out(self.base_address)
        self.cuMemAddressFree = ok

        def get_error_name(result: int, out: ctypes._CArgObject) -> int:
            out._obj.value = {2: b"CUDA_ERROR_OUT_OF_MEMORY"}.get(result)
            return 0 if out._obj.value else 1

        def create(out: ctypes._CArgObject, size: int, prop: ctypes._CArgObject, flags: int) -> int:
            assert prop._obj.type == 1 and prop._obj.location.type == 1 and size % self.granularity == 0
            if sum(self.handles.values()) + size > self.capacity:
                return 2
            out._obj.value = self._next_handle
            self.handles[self._next_handle] = size
            self._next_handle += 1
            return 0

        def mem_map(address: int, size: int, offset: int, handle: int, flags: int) -> int:
            assert handle in self.handles and address not in self.mappings
            self.mappings[address] = (size, handle)
            return 0

        def set_access(address: int, size: int, desc: ctypes._CArgObject, count: int) -> int:
            assert address in self.mappings and desc._obj.flags == 3 and count == 1
            self.accessible.add(address)
            return 0

        def unmap(address: int, size: int) -> int:
            assert self.mappings.pop(address)[0] == size
            self.accessible.discard(address)
            return 0

        def release(handle: int) -> int:
            assert handle not in {mapped_handle for _, mapped_handle in self.mappings.values()}
            del self.handles[handle]
            return 0

        self.cuGetErrorName = get_error_name
        self.cuMemCreate = create
        self.cuMemMap = mem_map
        self.cuMemSetAccess = set_access
        self.cuMemUnmap = unmap
        self.cuMemRelease = release


def fake_region(lib: FakeLibcuda, nbytes: int, chunk_bytes: int) -> tagged_memory._VmmRegion:
    driver = tagged_memory._CudaDriver(lib)
    target = tagged_memory._VmmDevice(driver, torch.device("cuda", 0), 0, lib.granularity)
    return tagged_memory._VmmRegion(target, nbytes, chunk_bytes)


def test_vmm_region_maps_in_chunks_and_remaps_at_the_same_addresses() -> None:
    lib = FakeLibcuda(capacity=64 * MiB)
    region = fake_region(lib, 5 * MiB, chunk_bytes=2 * MiB)
    chunk_addresses = [lib.base_address + offset for offset in (0, 2 * MiB, 4 * MiB)]
    assert region.nbytes == 6 * MiB and region.address == lib.base_address

    region.map_through(3 * MiB)  # packing maps only as far as the copy has come
    assert sorted(lib.mappings) == chunk_addresses[:2] == sorted(lib.accessible)
    region.map_through(region.nbytes)
    assert sorted(lib.mappings) == chunk_addresses == sorted(lib.accessible)

    region.unmap()
    assert lib.mappings == {} and lib.handles == {}  # every physical handle given back
    region.map_through(region.nbytes)
    assert sorted(lib.mappings) == chunk_addresses == sorted(lib.accessible)
    assert region.__cuda_array_interface__["data"] == (lib.base_address, False)


def test_vmm_region_out_of_memory_names_the_call_and_can_be_retried() -> None:
    lib = FakeLibcuda(capacity=4 * MiB)
    region = fake_region(lib, 6 * MiB, chunk_bytes=2 * MiB)
    with pytest.raises(CudaDriverError, match=r"cuMemCreate failed: CUresult 2 \(CUDA_ERROR_OUT_OF_MEMORY\)"):
        region.map_through(region.nbytes)
    assert len(lib.mappings) == 2 == len(lib.accessible)  # what fitted stays mapped
    lib.capacity = 6 * MiB
    region.map_through(region.nbytes)
    assert len(lib.mappings) == 3 == len(lib.accessible)


# ---- real CUDA virtual memory -----------------------------------------------------------


def gpu(test):
    """CUDA virtual memory: reads the device's free memory, so not beside other GPU test processes."""
    return pytest.mark.serial(pytest.mark.gpu(test))


SLACK = 16 * MiB  # allowed drift in the device's free-memory figure


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


@gpu
def test_gpu_allocation_is_vmm_backed_and_outside_torch_allocator() -> None:
    pool = TaggedMemoryPool("cuda")
    assert pool.device == torch.device("cuda", torch.cuda.current_device())
    torch_allocated = torch.cuda.memory_allocated()
    free_before = free_bytes()
    x = pool.allocate("kv_cache", (256, MiB // 4), torch.float32)  # 256 MiB
    assert x.is_cuda and x.is_contiguous() and torch.count_nonzero(x).item() == 0
    assert torch.cuda.memory_allocated() == torch_allocated
    assert free_before - free_bytes() >= pool.nbytes("kv_cache") - SLACK
    x.fill_(3.0)
    assert x.sum().item() == 3.0 * x.numel()


@gpu
def test_gpu_release_returns_memory_and_restore_brings_data_back_at_same_pointer() -> None:
    pool = TaggedMemoryPool("cuda")
    x = pool.allocate("weights", (1024, MiB // 4), torch.float32)  # 1 GiB
    values = torch.randn(1024, MiB // 4, device="cuda")
    x.copy_(values)
    pointer = x.data_ptr()
    nbytes = pool.nbytes("weights")

    free_before = free_bytes()
    pool.release("weights", offload=True)
    free_released = free_bytes()
    assert free_released - free_before >= nbytes - SLACK
    assert free_released - free_before <= nbytes + SLACK

    pool.restore("weights")
    assert abs(free_before - free_bytes()) <= SLACK
    assert x.data_ptr() == pointer
    assert torch.equal(x, values)

    pool.release("weights", offload=False)
    pool.restore("weights")
    assert torch.count_nonzero(x).item() == 0


@gpu
def test_gpu_cuda_graph_replays_after_release_and_restore_without_recapture() -> None:
    pool = TaggedMemoryPool("cuda")
    x = pool.allocate("weights", (4096,), torch.float32)
    x.fill_(1.5)
    out = torch.empty(4096, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out.copy_(x * 2)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(x * 2)

    pool.release("weights", offload=True)
    out.zero_()
    pool.restore("weights")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(out, 3.0))

    x.fill_(-4.0)  # an in-place update is seen by the same graph
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(out, -8.0))

    pool.release("weights", offload=False)
    pool.restore("weights")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.count_nonzero(out).item() == 0


@gpu
def test_gpu_pack_module_frees_torch_memory_and_keeps_outputs_across_sleep() -> None:
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)]).cuda().requires_grad_(False)  # 128 MiB
    tied = make_model("cuda")
    x = torch.randn(4, 2048, device="cuda")
    ids = torch.randint(0, 64, (2, 7), device="cuda")
    expected, expected_tied = model(x), tied(ids)
    weight_bytes = sum(parameter.nbytes for parameter in model.parameters())
    torch.cuda.synchronize()
    allocated_before = torch.cuda.memory_allocated()
    pool = TaggedMemoryPool("cuda")

    pool.pack_module(model, "weights")
    pool.pack_module(tied, "weights")

    assert allocated_before - torch.cuda.memory_allocated() >= weight_bytes  # torch's copies are gone
    assert torch.equal(model(x), expected) and torch.equal(tied(ids), expected_tied)
    assert tied.head.weight is tied.embed.weight
    pointers = [parameter.data_ptr() for parameter in model.parameters()]

    free_before = free_bytes()
    pool.release("weights", offload=True)
    assert free_bytes() - free_before >= pool.nbytes("weights") - SLACK
    pool.restore("weights")
    assert [parameter.data_ptr() for parameter in model.parameters()] == pointers
    assert torch.equal(model(x), expected) and torch.equal(tied(ids), expected_tied)


@gpu
def test_gpu_driver_error_names_the_call() -> None:
    TaggedMemoryPool("cuda")  # loads the driver and sets a context
    driver = tagged_memory._cuda_driver()
    device = driver.device(torch.cuda.current_device())
    with pytest.raises(CudaDriverError, match="cuMemCreate failed: CUresult"):
        driver.create(driver.granularity(device) + 1, device)  # not a multiple of the granularity
