"""Attention as the engine computes it: PyTorch paths (fused, chunked, full-matrix, paged) and kvlib's C kernels for
CPUs (`csrc/`, compiled on first use by `cpu_kernel`)."""
