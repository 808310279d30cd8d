"""Benchmarks that run against a real llama-server (see bench/README.md)."""
