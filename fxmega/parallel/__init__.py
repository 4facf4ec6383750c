"""What runs on the ranks: a sharding plan bound to this rank's process groups (``runtime.Parallel``),
its parameter shards, activation layouts, gradient synchronisation, ZeRO-3 gathers, the flat
distributed optimizer, context parallelism, and the process group setup."""
