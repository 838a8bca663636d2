"""Checks of the CUDA path, run on a machine with an NVIDIA GPU (`make gpu-check`); they skip elsewhere."""
