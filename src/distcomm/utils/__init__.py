"""Utilities for training on top of distcomm: data sharding (``distcomm.utils.data``)."""
