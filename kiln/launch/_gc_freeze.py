"""Imported last by kiln's fork servers (``kiln.launch.WORKER_PRELOAD``,
``kiln.launch.testing.FORKSERVER_PRELOAD``): what the server imported moves to the garbage
collector's permanent generation (``gc.freeze``, as Python's documentation advises before a
fork without exec), so that a forked rank's full collections walk only its own objects, not
torch's and kiln's modules, and leave the pages it shares with the server unwritten."""

import gc

gc.collect()
gc.freeze()
