"""The NVMe tier: page slots in preallocated files. ``pool`` (``NvmePool``, composing the rest),
``format`` (file layout, slot records, errors), ``files`` (open slot files, offsets, spans),
``slots`` (the slot table), ``buffers`` (aligned memory, page views), ``io`` (runs and vectored
calls), ``writer`` and ``reader`` (the write and read paths) and ``recovery`` (the slot table
rebuilt after a restart)."""
