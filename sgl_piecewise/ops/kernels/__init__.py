"""Triton kernels of the ops (``ops/``)."""
