"""Benchmarks that print one JSON line per figure: the engine against its peers
(`python -m common.bench.engine`) and the machine's memory bandwidth (`bandwidth.py`). The cluster
benchmark lives beside the router (`python -m router.bench`)."""
