"""Where the synchronizer's state lives: the control plane in Redis (its key schema, `keys`;
its check-and-set scripts, `lua/`; the client, `redis_store`) and fragment values in the
tensor store (`tensors`). Nothing here decides: it records and reads.
"""
