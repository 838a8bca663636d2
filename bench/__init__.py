"""Everything that measures: the benchmarks (`python -m bench.<name>`), each printing one JSON line per figure."""
