"""Ground floor: processes, ports, RPC, HTTP clients, devices and metrics (imports nothing above it)."""
