"""The virtual GPU: run an unmodified CUDA script without a GPU and predict its memory.

``cards`` holds the card table (memory as the driver reports it, compute capability,
CUDA context); ``workspaces`` what a real card allocates through the caching allocator
that is not one of the user's tensors (cuBLAS/cuBLASLt workspaces).
"""
