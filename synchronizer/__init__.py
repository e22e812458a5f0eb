"""atoll synchronizer: a pure core (`core/`), the stores it records in (`store/`), and a thin
shell of I/O around them (the owner, ingest, sessions, fetches, followers, the server).
docs/synchronizer.md walks through the rooms."""
