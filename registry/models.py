"""Models of the registry app."""
