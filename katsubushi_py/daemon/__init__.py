"""The asyncio daemon: listeners, per-connection glue, limits, STATS, graceful stop."""
