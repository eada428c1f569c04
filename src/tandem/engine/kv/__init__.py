"""KV-cache bookkeeping (no torch): the block pool and manager, per-head caches, the layouts the
scheduler talks to, transfer between replicas and hand-over of finished prefills."""
