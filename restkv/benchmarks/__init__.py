"""Benchmark data, prompts, generation loops and metrics.

The top-level run_*.py and eval*.py are thin command lines over these modules.
"""
