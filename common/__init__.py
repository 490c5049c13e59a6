"""Shared code of the eagle3-train stages: config, manifests, logging, data, models."""
import os

# vLLM starts its engine core and tensor-parallel workers with fork unless torch.cuda.is_initialized().
# A plain torch.cuda.is_available() / device_count() in the parent (our preflight) initialises the
# CUDA driver without setting that flag, and the forked child then dies with "Cannot re-initialize
# CUDA in forked subprocess" (seen on an H200, torch 2.11). With this set before the first such call,
# torch answers from NVML and leaves the driver alone. Every script imports `common` before it asks.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
