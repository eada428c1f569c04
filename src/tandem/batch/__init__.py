"""Files and batch jobs on the object store, batch workers. Not built yet: see the batch issue."""
