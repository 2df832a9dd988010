"""The nccl backend's internals; its public face is :mod:`jax_cgx.nccl`."""
