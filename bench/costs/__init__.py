"""What a feature costs per job: the same no-op load with it off and on, side by side."""
