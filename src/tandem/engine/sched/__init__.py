"""Scheduling (no torch): the waiting and running queues, admission against the KV budget, applying
a step's results, tenant fair shares, batch-lane policy and parallel sampling (`n`)."""
