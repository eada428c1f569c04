"""Model definitions and weight loaders."""
