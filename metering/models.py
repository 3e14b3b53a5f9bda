"""Models of the metering app."""
