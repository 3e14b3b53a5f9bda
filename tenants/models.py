"""Models of the tenants app."""
