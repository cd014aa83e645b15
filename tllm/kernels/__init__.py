"""Compute kernels. `tllm.kernels.triton` holds the Triton kernels, each beside its torch
reference; importing a kernel module needs `triton` (and, without a GPU, TRITON_INTERPRET=1 set
before the import)."""
