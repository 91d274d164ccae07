"""Disaggregated prefill between two engines on one host: a producer prefills, a consumer decodes.

`params`: the `kv_transfer_params` a router carries from the producer's answer to the consumer;
`scheduler`: both roles' scheduler halves (the producer holds a prefilled request's blocks, the
consumer waits for its pull); `producer` and `consumer`: their worker halves; `channel`: the
control messages (ZMQ, JSON); `shm`: the shared-memory segments the blocks cross in.

Transport, and why: the producer copies the requested blocks with the offload tier's
`BlockCopier` into a shared-memory segment in its block-major layout (one block contiguous
across all layers), and the consumer copies them from there into its own blocks. Shared memory
works on the CPU (so CI tests the whole path) and between two servers on one GPU, where NCCL
cannot join two processes on the same device; on CUDA each side stages through device memory and
one large host copy per run of blocks, as offload does. CUDA IPC handles would skip the host on
one GPU, but tie the consumer to the producer's allocator and device, and cannot be tested on
the CPU; NCCL between GPUs is out of scope here. A segment is created per pull and unmapped on
both sides once copied; the segment bytes are pageable (pinning each segment would cost about
what it saves at these sizes), a persistent registered pool is the next step for bandwidth.

Control, and why ZMQ: the blocks live in the producer's worker, not in its HTTP server's
process, so the consumer's worker asks the producer's worker directly on a ZMQ socket (by
default a private ipc path), with no hop through either server's event loop or engine-core pipe.
"""
