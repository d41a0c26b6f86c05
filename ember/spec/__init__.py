"""Speculative decoding."""
