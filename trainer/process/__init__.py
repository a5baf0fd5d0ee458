"""The job's processes and their failures: the first failing rank's report (`failure.py`), the agent lifeline,
the node a rank runs on, preemption signals, the dump folder's lock, host memory and garbage collection."""
