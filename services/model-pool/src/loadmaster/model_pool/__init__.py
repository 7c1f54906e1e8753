"""Loadmaster model-pool service."""
