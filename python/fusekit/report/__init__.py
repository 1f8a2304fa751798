"""Benchmark report: `python -m fusekit.report` renders committed results into markdown + PNG plots."""
