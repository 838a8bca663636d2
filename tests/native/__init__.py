"""Tests of the native decode kernels: bits against torch and across builds, batches and threads (no service)."""
