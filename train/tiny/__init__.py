"""Tiny random-init models and pipelines, built offline: the CPU demo and the tests run on them."""
