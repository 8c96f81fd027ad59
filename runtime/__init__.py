"""Runtime: device backends, memory manager, streams, channels, executors and the launcher."""
