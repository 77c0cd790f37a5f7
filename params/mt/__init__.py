"""Machine translation experiments (multilingual spelled-out numbers)."""
