"""Recorders that capture a training run as a PyTorch memory snapshot."""
