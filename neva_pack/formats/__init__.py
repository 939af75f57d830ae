"""On-disk formats: one module per format, each a matched writer and reader."""
