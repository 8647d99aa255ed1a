"""Tritium."""
