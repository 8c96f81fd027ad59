"""Scheduler: layer packing, configuration search, task graphs and the event-driven estimator."""
