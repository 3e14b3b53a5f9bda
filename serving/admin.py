"""Django admin registrations of the serving app."""
