"""A plugin package for Inflight's tests: one stage, registered by entry point."""
