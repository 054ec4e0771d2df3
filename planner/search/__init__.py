"""The two-level search: stage DP over layer profiles, finalists, forked workers."""
