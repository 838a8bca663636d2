"""The open-loop load generator: Poisson load on the services as pinned processes, per placement mode and mix."""
