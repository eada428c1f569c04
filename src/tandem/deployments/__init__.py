"""Ray Serve deployments (ingress, replicas, autoscaling, app builders). Not built yet: see the
real-time serving issue. Only this package and `tandem.batch` may import `ray`."""
