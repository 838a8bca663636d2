"""Tests of the router: its HTTP front, decode sessions, relay, routing, status, leases (real services in process)."""
