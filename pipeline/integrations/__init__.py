"""Integrations with the tools people run jobs in (Ray Data)."""
