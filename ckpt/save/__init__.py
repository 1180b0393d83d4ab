"""The path of a save's bytes: the snapshot into a memory slot, the background drain
(checksums, peers, disk), the commit protocol through the job's store, the upload, retention,
sweeping leftovers, run ownership and the shared-memory budget."""
