"""Training (the demo family, draft heads); never imported by a serving process."""
