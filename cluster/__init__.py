"""The cluster: its floor (configs) and the rooms above the workers: scheduling, pools, serve, bench, cli."""
