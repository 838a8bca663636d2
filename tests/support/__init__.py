"""What the tests share that is not a fixture: engines driven by hand, checkpoints written, clusters
started as processes, faults, certificates, native builds."""
