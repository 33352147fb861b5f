"""Data: raw sources, cached tokenization, batch order."""
