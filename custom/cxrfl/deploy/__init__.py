"""Deploying across hospitals with NVFlare's own tools: provisioning, kits, processes, admin."""
