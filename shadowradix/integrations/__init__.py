"""Adapters from the core to what engines and operators already run (optional dependencies)."""
