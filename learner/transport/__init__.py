"""The learner's transport, room for room as the synchronizer serves it: the control
session (session.py), updates to their owners (ingest.py), new global values from them
(follow.py), fetches of the current values (fetch.py), over the channels of calls.py and
into the values held (values.py). `learner.client.SynchronizerClient` is its facade."""
