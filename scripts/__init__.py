"""Measurement scripts that drive the real app or the default engine; run each as `python -m scripts.NAME`."""
