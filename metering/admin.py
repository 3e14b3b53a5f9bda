"""Django admin registrations of the metering app."""
