"""Loadmaster Python client SDK."""
