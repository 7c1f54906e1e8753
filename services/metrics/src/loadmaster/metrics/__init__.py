"""Loadmaster metrics service."""
