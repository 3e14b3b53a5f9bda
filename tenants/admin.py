"""Django admin registrations of the tenants app."""
