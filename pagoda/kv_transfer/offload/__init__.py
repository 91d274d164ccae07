"""CPU offload: prefix-cache blocks kept in a pinned host pool instead of being recomputed.

`HostBlockIndex` (scheduler side) maps block keys (the device prefix cache's own, so
`cache_salt` isolates tenants here too) to host slots, with its own LRU; `OffloadingScheduler`
turns evictions, finished requests and host hits into copy jobs; `OffloadingWorker` runs them
with `BlockCopier`, whose host layout keeps one block contiguous across all layers so a block
moves as one large copy.
"""
