"""``python -m pipeline.report PATH``: a local dashboard of runs in one HTML file."""
