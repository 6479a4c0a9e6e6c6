"""Workers: the floor (config/, errors) and the rooms below it: models, runtime, speculation, service, training."""
