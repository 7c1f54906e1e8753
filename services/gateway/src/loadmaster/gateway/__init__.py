"""Loadmaster gateway service."""
