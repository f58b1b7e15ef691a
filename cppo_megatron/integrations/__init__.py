"""Thin adapters that put the CPPO core into training frameworks; each imports its framework lazily."""
