"""Global hooks that see the script's real objects in their roles (parameters, buffers,
gradients, optimizer state, saved activations, the module running), and what they learn:
shared by every recorder."""
