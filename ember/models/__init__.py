"""Model files, weight formats and model families."""
