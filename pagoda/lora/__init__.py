"""LoRA adapters served over one base model: many adapters (and none) in one batch.

`request.py` names an adapter per request; `peft_loader.py` reads and checks PEFT adapter
directories; `manager.py` keeps a fixed number of adapters in device slots (LRU, with a CPU
cache behind them); `layers.py` adds each token's adapter delta to the base linear layers;
`mapping.py` holds the step's per-token slot index in persistent device tensors (so CUDA
graphs replay with any adapter mix); `ops.py` and `triton_ops.py` run the shrink/expand products.
"""
