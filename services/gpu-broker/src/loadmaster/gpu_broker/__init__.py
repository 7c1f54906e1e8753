"""Loadmaster gpu-broker service."""
