"""Figures drawn from result files (see visualize.py for the command line)."""
