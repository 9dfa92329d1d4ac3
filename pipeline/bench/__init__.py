"""``python -m pipeline.bench``: this project's collector against the reference points."""
