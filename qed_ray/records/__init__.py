"""The records wing: every file a sweep or a run puts on disk, one model each, and the one codec that writes and
reads them (strict JSON, atomic writes, bounded reads, the folder layout, seed-run records, checkpoint manifests and
pack records with ``state.pt`` I/O, result digests, the background writer, ``sweep.json``). It imports only the
floor (and torch inside the ``state.pt`` functions); every wing above reads and writes through it."""
