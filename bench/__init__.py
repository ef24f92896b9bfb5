"""Benchmarks for vllmini, each run side by side with its baseline."""
