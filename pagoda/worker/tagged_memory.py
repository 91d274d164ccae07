"""Tagged device memory (`weights`, `kv_cache`) that sleep mode can release and restore.

Mechanism: CUDA virtual memory management (VMM) through the driver API, called with ctypes
on libcuda. Each allocation reserves a virtual address range once (cuMemAddressReserve) and
backs it with physical memory (cuMemCreate at the device's granularity, cuMemMap,
cuMemSetAccess); torch sees it as a zero-copy tensor view (`__cuda_array_interface__`).
Release optionally copies the bytes to pinned CPU memory, then unmaps and frees the physical
memory (cuMemUnmap + cuMemRelease), keeping the virtual range: the device's own free-memory
figure rises. Restore maps new physical memory at the same addresses and copies the backup
back (or zero-fills). Addresses never change, so every tensor view and every CUDA graph
captured over them stays valid: graphs need no re-capture and weight updates are in-place
copies.

Why not the alternatives:
- torch's own allocator: memory torch frees goes back to its caching allocator, and tensors
  allocated again land at other addresses, so every graph would need re-capture.
- a pluggable allocator (CUDAPluggableAllocator / MemPool): it needs a compiled .so; ctypes
  on libcuda runs wherever the NVIDIA driver is, with no build step.

What stays valid across release/restore: the tensor objects handed out (and all views of
them), their data pointers on CUDA, and graphs captured over them. Contents come back only
when released with `offload=True`; otherwise restore zero-fills (as `allocate` does). Touching
a released tag is undefined: an illegal-address fault that kills the CUDA context, or a crash
on the CPU, so the engine must not run the model while asleep.

VMM memory is invisible to `torch.cuda.memory_allocated()`/`memory_reserved()`; it shows in
`torch.cuda.mem_get_info()` (as memory used outside torch's allocator) and in `nbytes(tag)`.

The CPU pool has the same interface over plain torch storages (release resizes the storage
to zero bytes, restore resizes it back), so the sleep/wake state machine is testable without
a GPU; there the tensor objects stay valid but their data pointers may change.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

_PACK_ALIGN = 256  # byte alignment of every storage packed into a region
_PACK_CHUNK_BYTES = 64 * 2**20  # physical memory mapped at a time while packing a module
_LIBCUDA_NAMES = ("libcuda.so.1", "libcuda.so")

# CUDA driver enums (cuda.h).
_CUDA_ERROR_OUT_OF_MEMORY = 2
_CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_HANDLE_TYPE_NONE = 0
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class TaggedMemoryError(RuntimeError):
    """Misuse of the pool: an unknown tag, or a tag in the wrong state."""


class VmmUnsupportedError(TaggedMemoryError):
    """No NVIDIA driver library, or a device without virtual memory management."""


class CudaDriverError(TaggedMemoryError):
    """A CUDA driver call failed; names the call and its CUresult."""

    def __init__(self, call: str, result: int, result_name: str) -> None:
        super().__init__(f"{call} failed: CUresult {result} ({result_name})")
        self.call = call
        self.result = result


# ---- ctypes view of the driver API (layouts as in cuda.h, 64-bit) ------------------------


class _CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CUmemAllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _CUmemAllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _CUmemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _CUmemAllocFlags),
    ]


class _CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", _CUmemLocation), ("flags", ctypes.c_int)]


_c_uint64_p = ctypes.POINTER(ctypes.c_uint64)
_SIGNATURES: dict[str, list[type]] = {
    "cuInit": [ctypes.c_uint],
    "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
    "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
    "cuCtxGetCurrent": [ctypes.POINTER(ctypes.c_void_p)],
    "cuCtxSetCurrent": [ctypes.c_void_p],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
    "cuMemGetAllocationGranularity": [
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.POINTER(_CUmemAllocationProp),
        ctypes.c_int,
    ],
    "cuMemAddressReserve": [_c_uint64_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_uint64],
    "cuMemAddressFree": [ctypes.c_uint64, ctypes.c_size_t],
    "cuMemCreate": [_c_uint64_p, ctypes.c_size_t, ctypes.POINTER(_CUmemAllocationProp), ctypes.c_uint64],
    "cuMemRelease": [ctypes.c_uint64],
    "cuMemMap": [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_uint64],
    "cuMemUnmap": [ctypes.c_uint64, ctypes.c_size_t],
    "cuMemSetAccess": [ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER(_CUmemAccessDesc), ctypes.c_size_t],
}


class _CudaDriver:
    """The few VMM calls the pool needs, each checked: a failure raises CudaDriverError."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        for name, argtypes in _SIGNATURES.items():
            try:
                function = getattr(lib, name)
            except AttributeError as exc:
                raise VmmUnsupportedError(f"the NVIDIA driver has no {name}: it is too old for CUDA VMM") from exc
            function.argtypes = argtypes
            function.restype = ctypes.c_int
        self._call("cuInit", 0)

    def _call(self, name: str, *args: object) -> None:
        result = getattr(self._lib, name)(*args)
        if result != 0:
            text = ctypes.c_char_p()
            known = self._lib.cuGetErrorName(result, ctypes.byref(text)) == 0 and text.value
            raise CudaDriverError(name, result, text.value.decode() if known else "unknown error")

    def device(self, ordinal: int) -> int:
        """The CUdevice of a device ordinal, with a current context on this thread."""
        device = ctypes.c_int()
        self._call("cuDeviceGet", ctypes.byref(device), ordinal)
        self.ensure_context(device.value)
        return device.value

    def ensure_context(self, device: int) -> None:
        """Driver calls need a current context; torch's runtime calls set the primary one."""
        context = ctypes.c_void_p()
        self._call("cuCtxGetCurrent", ctypes.byref(context))
        if context.value is None:
            self._call("cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
            self._call("cuCtxSetCurrent", context)

    def supports_vmm(self, device: int) -> bool:
        value = ctypes.c_int()
        self._call(
            "cuDeviceGetAttribute",
            ctypes.byref(value),
            _CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            device,
        )
        return value.value != 0

    def granularity(self, device: int) -> int:
        granularity = ctypes.c_size_t()
        self._call(
            "cuMemGetAllocationGranularity",
            ctypes.byref(granularity),
            ctypes.byref(_allocation_prop(device)),
            _CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
        return granularity.value

    def reserve(self, size: int, alignment: int) -> int:
        address = ctypes.c_uint64()
        self._call("cuMemAddressReserve", ctypes.byref(address), size, alignment, 0, 0)
        return address.value

    def free_address(self, address: int, size: int) -> None:
        self._call("cuMemAddressFree", address, size)

    def create(self, size: int, device: int) -> int:
        handle = ctypes.c_uint64()
        self._call("cuMemCreate", ctypes.byref(handle), size, ctypes.byref(_allocation_prop(device)), 0)
        return handle.value

    def map(self, address: int, size: int, handle: int) -> None:
        self._call("cuMemMap", address, size, 0, handle, 0)

    def set_access(self, address: int, size: int, device: int) -> None:
        """Make a mapped range readable and writable from `device` (needed after every map)."""
        access = _CUmemAccessDesc(
            _CUmemLocation(_CU_MEM_LOCATION_TYPE_DEVICE, device), _CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        )
        self._call("cuMemSetAccess", address, size, ctypes.byref(access), 1)

    def unmap(self, address: int, size: int) -> None:
        self._call("cuMemUnmap", address, size)

    def release(self, handle: int) -> None:
        self._call("cuMemRelease", handle)


def _allocation_prop(device: int) -> _CUmemAllocationProp:
    prop = _CUmemAllocationProp()
    prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = _CU_MEM_HANDLE_TYPE_NONE
    prop.location = _CUmemLocation(_CU_MEM_LOCATION_TYPE_DEVICE, device)
    return prop


@functools.cache
def _cuda_driver() -> _CudaDriver:
    errors = []
    for name in _LIBCUDA_NAMES:
        try:
            return _CudaDriver(ctypes.CDLL(name))
        except OSError as exc:
            errors.append(str(exc))
    raise VmmUnsupportedError(f"tagged CUDA memory needs the NVIDIA driver library: {'; '.join(errors)}")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# ---- regions: one allocation's memory, droppable and restorable at the same tensors ------


@dataclass(frozen=True)
class _VmmDevice:
    """What a VMM region needs to know about its device."""

    driver: _CudaDriver
    device: torch.device
    cu_device: int
    granularity: int


class _VmmRegion:
    """A reserved virtual range, backed in order by physical chunks of `chunk_bytes`.

    Tensors from `bytes_view` keep the region alive (torch holds the object that gave it
    the `__cuda_array_interface__`), so the range is freed only when the pool and every
    tensor over it are gone.
    """

    def __init__(self, target: _VmmDevice, nbytes: int, chunk_bytes: int) -> None:
        self.address: int | None = None
        self._target = target
        self._driver = target.driver
        self._cu_device = target.cu_device
        self.nbytes = _round_up(nbytes, target.granularity)
        chunk_bytes = _round_up(min(chunk_bytes, self.nbytes), target.granularity)
        self._chunks = [
            (offset, min(chunk_bytes, self.nbytes - offset)) for offset in range(0, self.nbytes, chunk_bytes)
        ]
        self._handles: list[int] = []  # physical handles of the first len(_handles) chunks
        self._accessible = 0  # how many of the mapped chunks have had their access set
        self.address = self._driver.reserve(self.nbytes, target.granularity)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.address, False), "version": 2, "strides": None}

    def bytes_view(self) -> torch.Tensor:
        return torch.as_tensor(self, device=self._target.device)

    @property
    def mapped_bytes(self) -> int:
        return sum(size for _, size in self._chunks[: len(self._handles)])

    def map_through(self, end: int) -> None:
        """Back [0, end) with physical memory (chunks already mapped stay as they are)."""
        self._driver.ensure_context(self._cu_device)
        self._grant_access()  # chunks a failed earlier call left mapped without access
        while len(self._handles) < len(self._chunks) and self.mapped_bytes < end:
            offset, size = self._chunks[len(self._handles)]
            handle = self._create(size)
            try:
                self._driver.map(self.address + offset, size, handle)
            except CudaDriverError:
                self._driver.release(handle)
                raise
            self._handles.append(handle)
            self._grant_access()

    def _grant_access(self) -> None:
        """Read/write access for this device on every mapped chunk (needed after each map)."""
        while self._accessible < len(self._handles):
            offset, size = self._chunks[self._accessible]
            self._driver.set_access(self.address + offset, size, self._cu_device)
            self._accessible += 1

    def _create(self, size: int) -> int:
        """cuMemCreate; on out-of-memory, hand torch's cached free blocks back and retry once."""
        try:
            return self._driver.create(size, self._cu_device)
        except CudaDriverError as exc:
            if exc.result != _CUDA_ERROR_OUT_OF_MEMORY:
                raise
        torch.cuda.empty_cache()
        return self._driver.create(size, self._cu_device)

    def unmap(self) -> None:
        self._driver.ensure_context(self._cu_device)
        while self._handles:
            offset, size = self._chunks[len(self._handles) - 1]
            self._driver.unmap(self.address + offset, size)
            self._driver.release(self._handles.pop())
            self._accessible = min(self._accessible, len(self._handles))

    def __del__(self) -> None:
        # Runs once no tensor refers to the range (or after a failed reserve). At interpreter
        # exit the driver and ctypes may already be torn down; a destructor cannot report a
        # failure usefully, so none is raised.
        if self.address is None:
            return
        try:
            self.unmap()
            self._driver.free_address(self.address, self.nbytes)
        except Exception:
            pass


class _HostRegion:
    """A plain torch byte buffer; release resizes its storage to zero bytes."""

    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.nbytes = _round_up(nbytes, _PACK_ALIGN)
        self._flat = torch.empty(self.nbytes, dtype=torch.uint8, device=device)

    def bytes_view(self) -> torch.Tensor:
        return self._flat

    def map_through(self, end: int) -> None:
        storage = self._flat.untyped_storage()
        if storage.nbytes() < self.nbytes:
            storage.resize_(self.nbytes)

    def unmap(self) -> None:
        self._flat.untyped_storage().resize_(0)


_Region = _VmmRegion | _HostRegion


@dataclass
class _TagState:
    regions: list[_Region] = field(default_factory=list)
    released: bool = False
    backups: list[torch.Tensor | None] = field(default_factory=list)  # per region, while released


class TaggedMemoryPool:
    """Device memory grouped by tag; each tag is released and restored as a whole.

    CUDA devices get VMM-backed memory (raises VmmUnsupportedError when the driver library or
    the device's VMM support is missing); the CPU gets plain torch storages.
    """

    def __init__(self, device: torch.device | str) -> None:
        device = torch.device(device)
        self._vmm: _VmmDevice | None = None
        if device.type == "cuda":
            driver = _cuda_driver()
            index = device.index if device.index is not None else torch.cuda.current_device()
            device = torch.device("cuda", index)
            cu_device = driver.device(index)
            if not driver.supports_vmm(cu_device):
                raise VmmUnsupportedError(f"device {device} does not support CUDA virtual memory management")
            self._vmm = _VmmDevice(driver, device, cu_device, driver.granularity(cu_device))
        elif device.type != "cpu":
            raise ValueError(f"device {device}: tagged memory supports 'cuda' and 'cpu' devices")
        self.device = device
        self._tags: dict[str, _TagState] = {}

    # ---- queries -------------------------------------------------------------------------

    @property
    def tags(self) -> tuple[str, ...]:
        return tuple(self._tags)

    def nbytes(self, tag: str) -> int:
        """Device bytes the tag holds when not released (granularity-rounded)."""
        return sum(region.nbytes for region in self._state(tag).regions)

    def is_released(self, tag: str) -> bool:
        return self._state(tag).released

    # ---- allocation ----------------------------------------------------------------------

    def allocate(self, tag: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled tensor of `shape` and `dtype` in its own region of `tag`."""
        shape = tuple(shape)
        if not shape or any(size <= 0 for size in shape):
            raise ValueError(f"shape {shape}: tagged allocations need every dimension >= 1")
        nbytes = math.prod(shape) * dtype.itemsize
        region = self._new_region(nbytes, chunk_bytes=nbytes)
        region.map_through(region.nbytes)
        flat = region.bytes_view()
        flat.zero_()
        self._writable_state(tag).regions.append(region)
        return flat[:nbytes].view(dtype).view(shape)

    @torch.no_grad()
    def pack_module(self, module: nn.Module, tag: str) -> int:
        """Move `module`'s state-dict tensors into one region of `tag`; returns its bytes.

        Moves the parameters and persistent buffers, everything a checkpoint can bring back
        after a release without offload; non-persistent buffers (derived caches such as
        rotary cos/sin tables) stay in torch's memory so they survive any release. Each
        distinct storage is copied whole and every tensor over it is repointed
        (`tensor.data = view`) at the same offset and strides, so tied weights and views stay
        shared. Physical memory is mapped as the copy advances while each original storage is
        dropped once copied, so the peak stays near the weight size plus one storage (the
        originals are freed only if nothing else holds them). Tensors outside the state dict
        that alias them keep the old storage.
        """
        storages: dict[int, list[torch.Tensor]] = {}
        for name, tensor in module.state_dict(keep_vars=True).items():
            if tensor.device != self.device:
                raise ValueError(f"pack_module: {name} is on {tensor.device}, the pool is on {self.device}")
            if tensor.is_inference():
                raise ValueError(f"pack_module: {name} is an inference tensor; build the model under torch.no_grad()")
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0:
                continue
            sharing = storages.setdefault(storage.data_ptr(), [])
            if not any(tensor is other for other in sharing):  # tied weights appear under two names
                sharing.append(tensor)
        if not storages:
            raise ValueError("pack_module: the module has no parameters or persistent buffers to pack")
        offsets, total = {}, 0
        for key, tensors in storages.items():
            offsets[key] = total
            total = _round_up(total + tensors[0].untyped_storage().nbytes(), _PACK_ALIGN)

        region = self._new_region(total, chunk_bytes=_PACK_CHUNK_BYTES)
        flat = region.bytes_view()
        for key, tensors in storages.items():
            offset = offsets[key]
            source = torch.empty(0, dtype=torch.uint8, device=self.device).set_(tensors[0].untyped_storage())
            region.map_through(offset + source.numel())
            flat[offset : offset + source.numel()].copy_(source)
            del source
            for tensor in tensors:
                itemsize = tensor.dtype.itemsize
                typed = flat.view(tensor.dtype)
                tensor.data = typed.as_strided(
                    tensor.shape, tensor.stride(), offset // itemsize + tensor.storage_offset()
                )
        region.map_through(region.nbytes)
        self._writable_state(tag).regions.append(region)
        return region.nbytes

    # ---- release and restore -------------------------------------------------------------

    def release(self, tag: str, offload: bool) -> None:
        """Free the tag's device memory; with `offload`, keep its bytes in (pinned) CPU memory."""
        state = self._state(tag)
        if state.released:
            raise TaggedMemoryError(f"tag {tag!r} is already released")
        self._synchronize()  # kernels still in flight may read or write the memory
        state.backups = [self._backup(region) if offload else None for region in state.regions]
        self._synchronize()
        for region in state.regions:
            region.unmap()
        state.released = True

    def restore(self, tag: str) -> None:
        """Give the tag device memory again at the same tensors: the backup's bytes, or zeros.

        Safe to call again after it failed part-way (for example out of memory).
        """
        state = self._state(tag)
        if not state.released:
            raise TaggedMemoryError(f"tag {tag!r} is not released")
        for region, backup in zip(state.regions, state.backups, strict=True):
            region.map_through(region.nbytes)
            flat = region.bytes_view()
            if backup is None:
                flat.zero_()
            else:
                flat.copy_(backup, non_blocking=True)
        self._synchronize()  # the pinned backups must outlive their copies
        state.backups = []
        state.released = False

    # ---- helpers -------------------------------------------------------------------------

    def _state(self, tag: str) -> _TagState:
        if tag not in self._tags:
            raise TaggedMemoryError(f"unknown tag {tag!r}; known tags: {sorted(self._tags)}")
        return self._tags[tag]

    def _writable_state(self, tag: str) -> _TagState:
        state = self._tags.setdefault(tag, _TagState())
        if state.released:
            raise TaggedMemoryError(f"tag {tag!r} is released; restore it before allocating into it")
        return state

    def _new_region(self, nbytes: int, chunk_bytes: int) -> _Region:
        if self._vmm is None:
            return _HostRegion(self.device, nbytes)
        return _VmmRegion(self._vmm, nbytes, chunk_bytes)

    def _backup(self, region: _Region) -> torch.Tensor:
        on_cuda = self.device.type == "cuda"
        backup = torch.empty(region.nbytes, dtype=torch.uint8, pin_memory=on_cuda)
        backup.copy_(region.bytes_view(), non_blocking=on_cuda)
        return backup

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
