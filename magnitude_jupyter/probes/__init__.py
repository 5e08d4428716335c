"""Measurements that start an engine in this process, beside `calibrate/` (which measures any server
through a client): a KV cache type's accuracy (`kv_quality`, on the runner itself) and its
throughput and capacity against the others (`cache_types`, an engine of each type in turn)."""
