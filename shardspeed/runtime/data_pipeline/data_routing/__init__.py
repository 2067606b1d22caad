"""Data routing: random layerwise token dropping (random-LTD)."""
