"""Hydra configs: veRL's trainer configs plus the `cppo` group."""
