"""fbt-probe: full-bandwidth transformers with per-pass caches, training and decoding."""

__version__ = "0.2.0"
