"""Django admin registrations of the registry app."""
