"""The GPU path: PyTorch's own allocator history on a real card, labelled by the hooks."""
