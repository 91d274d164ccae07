"""Mamba-2 state-space layers: the mixer (`MambaMixer2`), its per-step metadata, and the torch
reference ops the Triton kernels (`pagoda.model.ops.triton_mamba`) are checked against."""
