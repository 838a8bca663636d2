"""Tests of faults against real service processes: kill -9, cut-off and silent peers, Redis restarts."""
