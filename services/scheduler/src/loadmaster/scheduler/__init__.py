"""Loadmaster scheduler service."""
