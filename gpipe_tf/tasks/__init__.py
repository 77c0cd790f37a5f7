"""Tasks: a network, its loss and its metrics (classification, translation); docs/layout.md names them."""
