"""Loadmaster Python client SDK."""

from loadmaster.client.edge import Connection, Model, raise_for_error

__all__ = ["Connection", "Model", "raise_for_error"]
