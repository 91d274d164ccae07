"""KV transfer: moving KV blocks between the device cache and somewhere else.

A connector has two halves (see `interface`): the scheduler's, which decides what can be
loaded or must be saved and describes each step's transfers as plain data, and the worker's
(`pagoda.worker.kv_connector`), which moves the bytes. `offload` keeps prefix-cache blocks
in a pinned host pool.
"""
