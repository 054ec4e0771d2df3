"""Machine profiling: ``planner profile`` measures this machine and writes a cluster JSON."""
