"""`specserve bench`: which rows run, how they are timed and how the tables and plots are written."""
