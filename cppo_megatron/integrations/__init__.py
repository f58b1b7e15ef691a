"""Thin adapters that run the CPPO core inside other training frameworks (one folder each);
each imports its framework lazily."""
