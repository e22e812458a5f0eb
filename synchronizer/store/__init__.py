"""Where the synchronizer's state lives, behind one interface (`control.ControlStore`): the
control plane in Redis (its key schema, `keys`; its check-and-set scripts, `lua/`; the
client, `redis_store`), the same rules in memory for unit tests (`memory_store`), and
fragment values in the tensor store (`tensors`). Nothing here decides: it records and reads.
"""
