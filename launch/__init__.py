"""Multi-host launch: distributed initialization and launchers (uses the public API only)."""
