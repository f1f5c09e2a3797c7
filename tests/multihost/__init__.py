"""Tests that run the tasks of a cluster on separate hosts, simulated with network namespaces."""
