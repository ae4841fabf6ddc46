"""deltasync's services (the coordinator)."""
