"""Training pipeline for EAGLE draft heads: self-distilled data, target features, draft vocabulary, fitting.

`python -m engine.train all --out DIR` runs every stage with defaults; see `python -m engine.train -h`.
"""
