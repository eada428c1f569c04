"""Structured output: JSON-schema checks (no torch) and the grammar compiler."""
