"""Platform layer: configuration, errors and (later) schemas, object store, tenancy, telemetry.

Imports no other tandem subpackage; every other subpackage may import it.
"""
