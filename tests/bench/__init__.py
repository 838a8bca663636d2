"""Tests of the benchmarks' own logic: their figures are computed right (the figures themselves are not asserted)."""
