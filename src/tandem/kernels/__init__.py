"""Stateless tensor functions. Each documents its semantics and shapes and has a plain-torch
reference; device-specific implementations (Triton) must match the reference in tests."""
