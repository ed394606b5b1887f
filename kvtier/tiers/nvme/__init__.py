"""The NVMe tier: page slots in preallocated files. ``pool`` (``NvmePool``, the facade), ``format``
(file layout, slot records, errors), ``slots`` (allocation), ``io`` (positional reads and writes)
and ``recovery`` (the slot table rebuilt after a restart)."""
